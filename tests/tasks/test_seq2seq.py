import pytest
import torch

from tformer.config import config_from_dict
from tformer.decoding.translate import SearchOptions, best_translations
from tformer.loading import load_checkpoint
from tformer.tasks.seq2seq import Seq2SeqTask
from tformer.training.trainer import train


@pytest.fixture
def one_thread():
    # Two threads on two busy cores spend much of their time waiting for each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def builtin_config(steps: int, **data):
    return config_from_dict({
        "model": {"family": "seq2seq", "n_layer": 2, "n_head": 4, "d_model": 64, "d_ff": 256,
                  "dropout": 0.0, "max_len": 64},
        "data": {"tokenizer": "char", "builtin_pairs": 1000, "builtin_max": 999,
                 "val_fraction": 0.1, "max_tokens": 1200, "max_ratio": 12.0, "max_len": 64,
                 **data},
        "train": {"steps": steps, "lr": 4e-3, "min_lr": 1e-4, "warmup_steps": 30,
                  "beta2": 0.98, "weight_decay": 0.0, "eval_every": steps,
                  "checkpoint_every": steps, "log_every": 50},
    })


def test_a_tiny_model_learns_the_builtin_task(tmp_path, one_thread):
    """Numbers 0..999 in digits -> German words; 100 numbers never seen in training."""
    train(builtin_config(450), tmp_path / "run")
    loaded = load_checkpoint(tmp_path / "run")
    task = Seq2SeqTask(loaded.cfg, loaded.tokenizer)
    sources, references = task.data.val_text
    assert len(sources) == 100 and not set(sources) & set(
        loaded.tokenizer.decode(s) for s in task.data.train_src
    )
    hypotheses = best_translations(
        loaded.model, loaded.tokenizer, sources, SearchOptions(beam=4, max_len_a=12.0),
        batch_size=100,
    )
    exact = sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)
    assert exact >= 0.95, list(zip(sources, hypotheses, strict=True))[:10]


@pytest.mark.parametrize("data", [
    {},
    # About four batches an epoch: the stop falls in the second epoch, whose segmentation
    # the resumed run must draw again.
    {"tokenizer": "bpe", "vocab_size": 300, "bpe_dropout": 0.1},
], ids=["char", "bpe-dropout"])
def test_training_resumes_bit_exactly(tmp_path, one_thread, data):
    """10 steps straight equal 6 steps, a stop, and 4 more from the checkpoint."""
    straight = train(builtin_config(10, builtin_pairs=200, **data), tmp_path / "a")
    cfg = builtin_config(10, builtin_pairs=200, **data)
    train(cfg.replace("train", steps=6, checkpoint_every=6), tmp_path / "b")
    from tformer import loading

    resumed = train(cfg, tmp_path / "b", resume_from=loading.step_dir(tmp_path / "b", 6))
    assert resumed.step == straight.step == 10
    a = load_checkpoint(loading.step_dir(tmp_path / "a", 10)).model.state_dict()
    b = load_checkpoint(loading.step_dir(tmp_path / "b", 10)).model.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
