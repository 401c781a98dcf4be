"""Real short runs that the plot, TensorBoard, info and attention tests read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tformer.config import config_from_dict
from tformer.training.trainer import train

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
) * 20


def gpt_config(corpus: Path, *extra: str):
    return config_from_dict({}, [
        f"data.path={corpus}", "model.n_layer=2", "model.n_head=2", "model.d_model=32",
        "model.context=16", "train.batch_size=4", "train.steps=12", "train.warmup_steps=2",
        "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=12",
        "train.device=cpu", "train.tensorboard=true", *extra,
    ])


def seq2seq_config(*extra: str):
    return config_from_dict({"model": {"family": "seq2seq"}}, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
        "model.max_len=40", "data.tokenizer=char", "data.builtin_pairs=300",
        "data.builtin_max=999", "data.max_tokens=600", "data.max_len=40",
        "data.max_ratio=12.0", "data.val_bleu_every=1", "data.val_bleu_sentences=8",
        "train.steps=6", "train.eval_every=3", "train.checkpoint_every=6",
        "train.warmup_steps=1", "train.log_every=1", "train.device=cpu",
        "train.tensorboard=true", *extra,
    ])


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two GPT runs with different learning rates and one translation run with BLEU."""
    root = tmp_path_factory.mktemp("viz-runs")
    corpus = root / "tiny.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORMER_CACHE", str(root / "cache"))
        train(gpt_config(corpus, "train.lr=1e-3"), root / "gpt-a")
        train(gpt_config(corpus, "train.lr=3e-3", "train.min_lr=1e-4"), root / "gpt-b")
        train(seq2seq_config(), root / "numbers")
    return {"a": root / "gpt-a", "b": root / "gpt-b", "seq2seq": root / "numbers"}
