"""Two processes under torchrun (gloo, CPU) train each family to the same parameters as one
process with the same global batch."""

import csv
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tformer.training.distributed import Processes, shard

MODEL = "n_layer = 2\nn_head = 2\nd_model = 16\nd_ff = 32\ndropout = 0.0\n"
TRAIN = """
[train]
steps = 4
lr = 3e-3
warmup_steps = 1
accumulate = 2
eval_every = 4
checkpoint_every = 4
log_every = 1
device = "cpu"
parallel = "{parallel}"
"""
FAMILIES = {
    "gpt": '[model]\nfamily = "gpt"\ncontext = 16\n{model}\n[data]\npath = "{corpus}"\n'
    "[train]\nbatch_size = 6\n",
    "transformer-xl": '[model]\nfamily = "transformer-xl"\ncontext = 8\nmem_len = 8\n{model}\n'
    '[data]\npath = "{corpus}"\n[train]\nbatch_size = 4\n',
    "seq2seq": '[model]\nfamily = "seq2seq"\nmax_len = 32\n{model}\n[data]\ntokenizer = "char"\n'
    "builtin_pairs = 300\nbuiltin_max = 9999\nmax_tokens = 200\nmax_len = 32\nmax_ratio = 12.0\n"
    "val_bleu_every = 1\n",
}


def write_config(tmp_path, family, corpus, parallel="ddp"):
    text = FAMILIES[family].format(model=MODEL, corpus=corpus)
    # The [train] keys of the family's snippet and the shared ones form one table.
    head, _, family_train = text.partition("[train]\n")
    path = tmp_path / f"{family}.toml"
    path.write_text(head + TRAIN.format(parallel=parallel) + family_train)
    return path


def run(args, nproc=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "tformer", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "tformer",
            *args,
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def weights(run_dir):
    """The final weights, less the attention key biases: softmax ignores a shift shared by
    all keys, so their true gradient is zero, and Adam turns the rounding noise they get
    instead into steps of size ~lr whose sign depends on the order of the sums."""
    out = {}
    for name, w in load_file(run_dir / "checkpoints" / "step-000004" / "model.safetensors").items():
        if name.endswith("qkv_proj.bias"):  # [q | k | v], with equal q and k sizes here
            d = 16
            w = torch.cat([w[:d], w[2 * d :]])
        elif name.endswith("kv_proj.bias"):  # [k | v]
            w = w[16:]
        out[name] = w
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,parallel,optimizer",
    [(family, "ddp", "adamw") for family in FAMILIES]
    + [("gpt", "fsdp", "adamw"), ("transformer-xl", "fsdp", "adamw"), ("gpt", "ddp", "muon")],
)
def test_two_processes_match_one(tmp_path, tiny_corpus, family, parallel, optimizer):
    config = write_config(tmp_path, family, tiny_corpus, parallel)
    chosen = f"train.optimizer={optimizer}"
    run(["train", str(config), "--out", str(tmp_path / "one"), chosen])
    run(["train", str(config), "--out", str(tmp_path / "two"), chosen], nproc=2)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=2e-5, rtol=1e-4, msg=name)
    # Each process validated its share of the rows; the shares add up to one process's loss.
    assert val_column(tmp_path / "two") == pytest.approx(val_column(tmp_path / "one"), rel=1e-4)
    if family == "seq2seq":
        # Under DDP each process translated every second sentence; the gathered
        # translations score as one process's.
        for column in ("bleu", "chrf"):
            one = val_column(tmp_path / "one", column)
            assert one and val_column(tmp_path / "two", column) == one


def val_column(run_dir, column="loss"):
    with open(run_dir / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r["split"] == "val" and r[column]]


@pytest.mark.slow
def test_resume_with_another_number_of_processes(tmp_path, tiny_corpus):
    config = write_config(tmp_path, "gpt", tiny_corpus)
    # A constant rate, so that stopping after 2 of 4 steps changes no learning rate.
    run(["train", str(config), "--out", str(tmp_path / "one"), "train.schedule=constant"])
    run(
        [
            "train",
            str(config),
            "--out",
            str(tmp_path / "mixed"),
            "train.steps=2",
            "train.checkpoint_every=2",
            "train.schedule=constant",
        ],
        nproc=2,
    )
    run(
        [
            "train",
            "--resume",
            "--out",
            str(tmp_path / "mixed"),
            "train.steps=4",
            "train.checkpoint_every=4",
        ]
    )
    one, mixed = weights(tmp_path / "one"), weights(tmp_path / "mixed")
    for name in one:
        torch.testing.assert_close(mixed[name], one[name], atol=2e-5, rtol=1e-4, msg=name)


def test_shard_gives_each_rank_its_rows():
    from tformer.data.lm import LMBatch

    batch = LMBatch(torch.arange(10)[:, None], torch.arange(10)[:, None])
    parts = [
        shard(batch, Processes(rank=r, world_size=3)).tokens.flatten().tolist() for r in range(3)
    ]
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
