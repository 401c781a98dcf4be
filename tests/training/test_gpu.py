"""Training on a CUDA device: a bf16 step, and FSDP in one process. Marked gpu: skipped
where torch sees no CUDA device (tests/conftest.py), run by `make test-gpu`."""

import copy
import csv

import pytest
import torch
import torch.distributed as dist

from tformer.config import config_from_dict
from tformer.evaluation.loss import lm_loss
from tformer.models.gpt import GPT, GPTConfig
from tformer.training.device import autocast
from tformer.training.trainer import train

pytestmark = pytest.mark.gpu


def tiny_config(corpus, *extra):
    return config_from_dict({}, [
        f"data.path={corpus}", "model.n_layer=2", "model.n_head=2", "model.d_model=64",
        "model.context=32", "model.dropout=0.0", "model.bias=false", "train.batch_size=8",
        "train.steps=6", "train.warmup_steps=1", "train.lr=3e-3", "train.min_lr=3e-4",
        "train.log_every=1", "train.eval_every=6", "train.checkpoint_every=6", *extra,
    ])


def train_losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


def test_bf16_training_on_the_gpu_follows_fp32_on_the_cpu(tiny_corpus, tmp_path):
    train(tiny_config(tiny_corpus, "train.device=cpu", "train.precision=fp32"), tmp_path / "cpu")
    # precision auto is bf16 on a GPU that has it.
    train(tiny_config(tiny_corpus, "train.device=cuda", "train.precision=auto"), tmp_path / "gpu")
    cpu, gpu = train_losses(tmp_path / "cpu"), train_losses(tmp_path / "gpu")
    assert len(cpu) == len(gpu) == 6
    torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=3e-2, atol=0)
    assert gpu != cpu, "the GPU run really computed in bf16"


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_in_one_process_trains_like_the_plain_model(one_process_group):
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda")
    cfg = GPTConfig(vocab_size=97, context=32, n_layer=2, n_head=2, d_model=64, bias=False)
    plain = GPT(cfg).to(device)
    sharded = copy.deepcopy(plain)
    for block in sharded.blocks:  # as tformer.training.distributed.wrap does
        fully_shard(block)
    fully_shard(sharded)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded)]
    data = torch.randint(0, 97, (3, 8, 33), generator=torch.Generator().manual_seed(0))
    for batch in data.to(device):
        for model, optimizer in zip((plain, sharded), optimizers, strict=True):
            with autocast(device, "bf16"):
                loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    full = {name: p.full_tensor() for name, p in sharded.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], p, atol=1e-5, rtol=1e-4, msg=name)
