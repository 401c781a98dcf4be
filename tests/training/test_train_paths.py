"""Training paths that must not change what is learned: gradient accumulation, bf16
autocast, torch.compile."""

import csv
import math

import pytest
import torch
from safetensors.torch import load_file

from tformer.config import config_from_dict
from tformer.training.trainer import train


def tiny_config(corpus, *extra):
    # No biases: a key bias has zero true gradient, and Adam would turn its rounding noise
    # into full-size steps whose sign depends on the order of the sums.
    return config_from_dict({}, [
        f"data.path={corpus}", "model.n_layer=2", "model.n_head=2", "model.d_model=32",
        "model.context=16", "model.dropout=0.0", "model.bias=false", "train.steps=4",
        "train.warmup_steps=1", "train.lr=3e-3", "train.min_lr=3e-4", "train.log_every=1",
        "train.eval_every=4", "train.checkpoint_every=4", "train.device=cpu", *extra,
    ])


def final_weights(run_dir, step=4):
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def train_losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


def test_accumulating_k_batches_of_b_equals_one_batch_of_k_times_b(tiny_corpus, tmp_path):
    # The windows of k draws of B rows are those of one draw of k * B rows (one generator).
    train(tiny_config(tiny_corpus, "train.batch_size=12"), tmp_path / "one")
    train(tiny_config(tiny_corpus, "train.batch_size=4", "train.accumulate=3"), tmp_path / "acc")
    one, acc = final_weights(tmp_path / "one"), final_weights(tmp_path / "acc")
    assert one.keys() == acc.keys()
    for name in one:
        torch.testing.assert_close(acc[name], one[name], atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(train_losses(tmp_path / "acc"), train_losses(tmp_path / "one"),
                               atol=1e-5, rtol=1e-5)
    # And it is not vacuous: other windows give other weights.
    train(tiny_config(tiny_corpus, "train.batch_size=4"), tmp_path / "small")
    small = final_weights(tmp_path / "small")
    assert any(not torch.allclose(small[n], one[n], atol=1e-4) for n in one)


def test_bf16_autocast_on_the_cpu_trains_like_fp32(tiny_corpus, tmp_path):
    extra = ("train.batch_size=4", "train.steps=8", "train.eval_every=8",
             "train.checkpoint_every=8")
    train(tiny_config(tiny_corpus, *extra), tmp_path / "fp32")
    train(tiny_config(tiny_corpus, *extra, "train.precision=bf16"), tmp_path / "bf16")
    fp32, bf16 = train_losses(tmp_path / "fp32"), train_losses(tmp_path / "bf16")
    # bf16 keeps 8 bits of mantissa: the losses agree to about 1%, not to fp32's rounding.
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=2e-2, atol=0)
    assert bf16 != fp32, "autocast really ran in bf16"
    weights = final_weights(tmp_path / "bf16", 8)
    assert all(w.dtype == torch.float32 for w in weights.values()), "master weights stay fp32"


@pytest.mark.slow
def test_a_compiled_model_trains_like_the_plain_one(tiny_corpus, tmp_path):
    train(tiny_config(tiny_corpus, "train.batch_size=4"), tmp_path / "plain")
    train(tiny_config(tiny_corpus, "train.batch_size=4", "train.compile=true"),
          tmp_path / "compiled")
    plain, compiled = final_weights(tmp_path / "plain"), final_weights(tmp_path / "compiled")
    for name in plain:
        torch.testing.assert_close(compiled[name], plain[name], atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.slow
def test_a_compiled_model_with_dropout_trains(tiny_corpus, tmp_path):
    """Under torch.compile, dropout and the loss are torch's inside the graph (tformer's
    kernels step aside while compiling): training runs and learns."""
    result = train(tiny_config(tiny_corpus, "train.batch_size=4", "train.compile=true",
                               "model.dropout=0.2", "train.steps=8", "train.eval_every=8",
                               "train.checkpoint_every=8"), tmp_path / "compiled")
    losses = train_losses(tmp_path / "compiled")
    assert result.skipped_steps == 0 and all(map(math.isfinite, losses))
    assert losses[-1] < losses[0]
