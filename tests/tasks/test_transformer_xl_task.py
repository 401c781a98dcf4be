import csv

import pytest
import torch
from safetensors.torch import load_file

from tformer import loading
from tformer.config import config_from_dict
from tformer.data.streams import eval_streams
from tformer.data.tokenizers import IGNORE_INDEX
from tformer.evaluation.loss import lm_loss
from tformer.models.transformer_xl import Memory
from tformer.registry import get_family
from tformer.tasks.transformer_xl import TransformerXLTask, evaluate_text
from tformer.training import checkpoint as ckpt
from tformer.training.trainer import train


def tiny_config(corpus, *extra):
    return config_from_dict({}, [
        "model.family=transformer-xl", f"data.path={corpus}", "model.n_layer=2",
        "model.n_head=2", "model.d_model=16", "model.d_ff=32", "model.context=8",
        "model.mem_len=8", "model.dropout=0.1", "train.batch_size=3", "train.steps=6",
        "train.warmup_steps=1", "train.log_every=1", "train.eval_every=2",
        "train.eval_batches=2", "train.checkpoint_every=2", "train.keep_checkpoints=5",
        "train.device=cpu", *extra,
    ])


def train_losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


def test_a_crashed_run_resumes_bit_identically_memory_included(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus)
    train(cfg, tmp_path / "straight")

    def crash(info):
        if info["step"] == 3:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        train(cfg, tmp_path / "crashed", progress=crash)
    latest = loading.latest_good_checkpoint(tmp_path / "crashed")
    assert latest.name == "step-000002"
    state = ckpt.load_trainer_state(latest)
    carry = state["carry_per_rank"][0]
    assert len(carry["memory"]["states"]) == 2, "the memory travels with the checkpoint"
    train(cfg, tmp_path / "crashed", resume_from=latest)

    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "straight")
    final = "checkpoints/step-000006/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "crashed" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_accumulated_micro_batches_are_consecutive_segments(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, "train.steps=2", "train.accumulate=2")
    train(cfg, tmp_path / "acc")
    state = ckpt.load_trainer_state(tmp_path / "acc" / "checkpoints" / "step-000002")
    assert state["data_per_rank"][0]["segment"] == 4 and state["data_per_rank"][0]["epoch"] == 0


def test_the_training_memory_carries_over_and_clears_at_a_new_epoch(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "model.dropout=0.0", "train.batch_size=12")
    task = TransformerXLTask(cfg)
    model = get_family("transformer-xl").model(
        cfg.replace("model", **task.model_fields()).model)
    batches = task.train_batches(0)
    memory, starts = task.new_carry(), 0
    with torch.no_grad():
        for _ in range(40):
            batch = next(batches)
            before = memory
            _, _, memory = task.loss(model, batch, memory)
            assert memory.length == 8 and memory is not before
            if batch.first:
                starts += 1
                # A new epoch starts with an empty memory: the loss equals a fresh one's.
                fresh, _, _ = task.loss(model, batch, task.new_carry())
                stale, _, _ = task.loss(model, batch, before)
                assert torch.equal(stale, fresh)
            else:
                # The memory carried in is the one the previous segment left: attending
                # over it scores this segment differently from an empty memory.
                fresh, _, _ = task.loss(model, batch, task.new_carry())
                carried, _, _ = task.loss(model, batch, before)
                assert not torch.equal(carried, fresh)
            # The memory left holds each layer's input at this segment's 8 positions: the
            # first layer's is the scaled embedding of the segment's tokens (no dropout here).
            embedded = model.embed(batch.tokens) * model.embed_scale
            torch.testing.assert_close(memory.states[0], embedded)
    assert starts == 2, "the tiny corpus wraps around once in 40 segments"


def test_the_memory_handed_in_is_not_changed(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "model.dropout=0.0")
    task = TransformerXLTask(cfg)
    model = get_family("transformer-xl").model(
        cfg.replace("model", **task.model_fields()).model)
    batches = task.train_batches(0)
    with torch.no_grad():
        _, _, memory = task.loss(model, next(batches), task.new_carry())
        kept = [m.clone() for m in memory.states]
        _, _, after = task.loss(model, next(batches), memory)
    assert all(torch.equal(a, b) for a, b in zip(memory.states, kept, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after.states, kept, strict=True))


def test_evaluation_equals_a_hand_written_walk(tiny_corpus):
    cfg = tiny_config(tiny_corpus, "model.dropout=0.0", "model.eval_mem_len=5")
    task = TransformerXLTask(cfg)
    model = get_family("transformer-xl").model(
        cfg.replace("model", **task.model_fields()).model).eval()
    ids = task.data.val_ids
    result = evaluate_text(model, ids, task.tokenizer, cfg)
    memory, total, count = Memory(5), 0.0, 0
    for batch in eval_streams(ids, 3, 8):
        with torch.no_grad():
            logits = model(batch.tokens, memory=memory)
        total += float(lm_loss(logits, batch.targets, reduction="sum"))
        count += int((batch.targets != IGNORE_INDEX).sum())
    assert count == len(ids) - 1 == result["tokens"]
    assert result["loss"] == pytest.approx(total / count, rel=1e-6)


def test_one_stream_with_a_long_memory_equals_one_causal_pass(tiny_corpus):
    """Walking the text in segments with a memory that never forgets scores every token as
    one causal pass over the whole text does."""
    cfg = tiny_config(tiny_corpus, "model.dropout=0.0", "train.batch_size=1",
                      "model.eval_mem_len=100000")
    task = TransformerXLTask(cfg)
    model = get_family("transformer-xl").model(
        cfg.replace("model", **task.model_fields()).model).eval()
    ids = torch.from_numpy(task.data.val_ids.astype("int64"))[None]
    with torch.no_grad():
        whole = float(lm_loss(model(ids[:, :-1]), ids[:, 1:]))
    assert evaluate_text(model, task.data.val_ids, task.tokenizer, cfg)["loss"] == pytest.approx(
        whole, rel=1e-5)


def test_memory_saved_by_another_process_layout_is_not_restored(tiny_corpus, monkeypatch):
    from tformer.tasks import transformer_xl

    cfg = tiny_config(tiny_corpus, "model.dropout=0.0")
    task = TransformerXLTask(cfg)
    model = get_family("transformer-xl").model(
        cfg.replace("model", **task.model_fields()).model)
    batches = task.train_batches(0)
    with torch.no_grad():
        _, _, memory = task.loss(model, next(batches), task.new_carry())
    saved = task.save_carry(memory)
    restored = TransformerXLTask(cfg, task.tokenizer).load_carry(saved)
    assert restored.length == 8
    assert all(torch.equal(a, b) for a, b in zip(restored.states, memory.states, strict=True))
    monkeypatch.setattr(transformer_xl, "process_slot", lambda: (1, 2))
    elsewhere = TransformerXLTask(cfg, task.tokenizer).load_carry(saved)
    assert elsewhere.length == 0
