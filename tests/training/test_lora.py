"""LoRA: the adapted layer against a hand computation, merging, which parameters train, the
checkpoints of a LoRA run and its base reference, exact resume, and every family."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import TINY_TEXT
from tformer import loading
from tformer.cli import main
from tformer.config import LoRAConfig, config_from_dict
from tformer.errors import TformerError
from tformer.kernels.quantize import FrozenInt8Linear
from tformer.models.gpt import GPT, GPTConfig
from tformer.registry import get_family
from tformer.training import lora, trainer
from tformer.training.trainer import optimizer_step, start_run, stop_requests

TINY = ["model.n_layer=2", "model.d_model=16", "model.n_head=2", "model.context=8",
        "train.batch_size=2", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2",
        "train.warmup_steps=1", "train.log_every=1", "train.device=cpu", "train.lr=1e-2"]


def gpt_config(tmp_path: Path, corpus: Path) -> Path:
    path = tmp_path / "gpt.toml"
    path.write_text(f'[model]\nfamily = "gpt"\n[data]\npath = "{corpus}"\n')
    return path


def randomise_adapters(model: nn.Module, seed: int = 1) -> None:
    """B is zero at the start; random B makes the adapters change the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.adapted_layers(model).values():
            w = layer.lora_B.weight
            w.copy_(torch.randn(w.shape, generator=generator) * 0.3)


def tiny_model(family: str) -> nn.Module:
    fields = {"gpt": {"context": 8}, "transformer-xl": {"context": 8, "mem_len": 8},
              "seq2seq": {"d_ff": 32}}[family]
    cfg = config_from_dict({"model": {"family": family, "vocab_size": 23, "n_layer": 2,
                                      "d_model": 16, "n_head": 2, **fields}})
    return get_family(family).model(cfg.model).eval()


def forward(model: nn.Module, family: str, tokens: torch.Tensor) -> torch.Tensor:
    if family == "seq2seq":
        return model(tokens, torch.ones_like(tokens, dtype=torch.bool), tokens[:, :4])
    if family == "transformer-xl":
        # Two segments, the second over the first's memory: the memory's keys and values
        # go through the adapted projection too.
        from tformer.models.transformer_xl import Memory

        memory = Memory(model.cfg.mem_len)
        first = model(tokens[:, :4], memory=memory)
        return torch.cat([first, model(tokens[:, 4:], memory=memory)], dim=1)
    out = model(tokens)
    return out[0] if isinstance(out, tuple) else out


def test_an_adapted_layer_is_w_x_plus_scaled_b_a_x():
    base = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    expected_base = x @ base.weight.T + base.bias
    layer = lora.LoRALinear(base, r=2, alpha=3.0, dropout=0.0)
    assert torch.equal(layer(x), base(x))  # B = 0: the base model's outputs exactly
    layer.lora_B.weight.data.normal_()
    a, b = layer.lora_A.weight, layer.lora_B.weight
    by_hand = expected_base + 1.5 * (x @ a.T) @ b.T
    assert torch.allclose(layer(x), by_hand, atol=1e-6)
    assert layer.weight is base.weight and layer.bias is base.bias


@pytest.mark.parametrize("family", ["gpt", "seq2seq", "transformer-xl"])
def test_merged_model_gives_the_adapted_models_outputs(family):
    model = tiny_model(family)
    names = lora.add_adapters(model, LoRAConfig(r=4, alpha=8.0, targets="all"))
    assert names and all(any(p.isdigit() for p in n.split(".")) for n in names)
    randomise_adapters(model)
    # In float64, so that what is compared is the merge, not float32's rounding of it (in
    # float32 the two differ by a few ulps of the logits, ~1e-6).
    model.double().eval()
    tokens = torch.randint(0, 23, (2, 8))
    with torch.no_grad():
        adapted = forward(model, family, tokens)
        lora.merge(model)
        merged = forward(model, family, tokens)
    assert not lora.adapted_layers(model)
    assert (adapted - merged).abs().max() <= 1e-6


def test_targets_pick_block_layers_by_name_never_embeddings_or_head():
    model = GPT(GPTConfig(vocab_size=11, n_layer=2, d_model=8, n_head=2, context=4))
    every = lora.target_modules(model, LoRAConfig())
    assert sorted(every) == sorted(f"blocks.{i}.{n}" for i in range(2) for n in
                                   ("attn.qkv_proj", "attn.out_proj", "ff.up", "ff.down"))
    some = lora.target_modules(model, LoRAConfig(targets=["qkv_proj", "down"]))
    assert sorted(some) == ["blocks.0.attn.qkv_proj", "blocks.0.ff.down",
                            "blocks.1.attn.qkv_proj", "blocks.1.ff.down"]
    with pytest.raises(TformerError, match="no linear layer 'qkv_prj'.*did you mean"):
        lora.target_modules(model, LoRAConfig(targets=["qkv_prj"]))


def test_the_lora_table_from_toml_and_dotted_overrides():
    cfg = config_from_dict({"train": {"lora": {"r": 4, "targets": ["qkv_proj"]}}},
                           ["train.lora.alpha=2", "train.lora.dropout=0.1"])
    assert cfg.train.lora == LoRAConfig(r=4, alpha=2.0, dropout=0.1, targets=("qkv_proj",))
    assert config_from_dict(cfg.to_dict()).train.lora == cfg.train.lora  # JSON round trip
    assert config_from_dict({}, ["train.lora.r=16"]).train.lora.r == 16
    assert config_from_dict({}).train.lora is None
    with pytest.raises(TformerError, match=r"unknown key train\.lora\.rank"):
        config_from_dict({}, ["train.lora.rank=4"])
    with pytest.raises(TformerError, match=r"train\.lora\.r = 0 must be at least 1"):
        config_from_dict({}, ["train.lora.r=0"])


def test_only_the_adapters_train_and_have_optimizer_state(tmp_path, tiny_corpus):
    cfg = config_from_dict({"model": {"family": "gpt"}, "data": {"path": str(tiny_corpus)}},
                           [*TINY, "train.lora.r=2", "train.lora.targets=[\"qkv_proj\"]"])
    run = start_run(cfg, tmp_path / "run", None)
    names = {id(p): n for n, p in run.model.named_parameters()}
    in_optimizer = {names[id(p)] for g in run.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {f"blocks.{i}.attn.qkv_proj.lora_{ab}.weight"
                            for i in range(2) for ab in "AB"}
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}

    with stop_requests() as stop:
        optimizer_step(run, stop)
    for name, p in run.model.named_parameters():
        moved = not torch.equal(p, before[name])
        if name not in in_optimizer:
            assert not moved and p.grad is None, name
        elif name.endswith("lora_B.weight"):
            assert moved, name
    state_of = {names[id(p)] for p in run.optimizer.state}
    assert state_of == in_optimizer


def test_a_lora_run_saves_adapters_and_a_base_reference(tmp_path, tiny_corpus, capsys):
    config = gpt_config(tmp_path, tiny_corpus)
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert main(["train", str(config), "--out", str(base), *TINY]) == 0
    assert main(["train", str(config), "--out", str(tuned), *TINY, f"train.init_from={base}",
                 "train.lora.r=2", "train.lora.targets=[\"qkv_proj\", \"out_proj\"]"]) == 0
    assert "lora    384 of " in capsys.readouterr().err  # 2 x (2 x 16 + 48 x 2 + 2 x 16 + 16 x 2)
    step = loading.step_dir(tuned, 4)
    assert not (step / loading.WEIGHTS).exists()
    adapters = load_file(step / loading.ADAPTERS)
    assert all(".lora_" in name for name in adapters) and len(adapters) == 8
    reference = json.loads((step / loading.LORA_BASE).read_text())
    assert reference["sha256"] == loading.sha256_of(loading.resolve_checkpoint(base) /
                                                    loading.WEIGHTS)

    # Loaded, it is the base with the adapters merged: the training model's outputs.
    loaded = loading.load_checkpoint(step)
    model = loading.load_checkpoint(base).model
    lora.add_adapters(model, LoRAConfig(r=2, targets=["qkv_proj", "out_proj"]))
    lora.load_adapters(model, adapters, step)
    tokens = torch.randint(0, loaded.tokenizer.vocab_size, (2, 8))
    with torch.no_grad():
        assert (loaded.model(tokens) - model.eval()(tokens)).abs().max() <= 1e-6
        assert not torch.equal(loaded.model(tokens), loading.load_checkpoint(base).model(tokens))
    assert main(["generate", str(tuned), "--prompt", "First", "--max-new-tokens", "4"]) == 0
    assert main(["evaluate", str(tuned), "--json"]) == 0
    # Averaged, LoRA checkpoints are the mean of their merged weights, a plain checkpoint.
    averaged = tmp_path / "averaged"
    assert main(["average", str(tuned), "--last", "2", "--out", str(averaged)]) == 0
    mean = loading.load_checkpoint(averaged)
    assert mean.cfg.train.lora is None and (averaged / loading.WEIGHTS).is_file()
    states = [loading.load_checkpoint(loading.step_dir(tuned, s)).model.state_dict()
              for s in (2, 4)]
    for name, tensor in mean.model.state_dict().items():
        assert torch.allclose(tensor, (states[0][name] + states[1][name]) / 2, atol=1e-6), name


def test_a_changed_or_missing_base_is_a_one_line_error(tmp_path, tiny_corpus, capsys):
    config = gpt_config(tmp_path, tiny_corpus)
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert main(["train", str(config), "--out", str(base), *TINY]) == 0
    assert main(["train", str(config), "--out", str(tuned), *TINY, f"train.init_from={base}",
                 "train.lora.r=2"]) == 0
    capsys.readouterr()
    # The base trains on: its best/ (what the run adapted) is replaced.
    assert main(["train", "--resume", "--out", str(base), "train.steps=8"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tuned), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "holds LoRA adapters for the base checkpoint" in err and "missing" in err
    assert err.count("\n") == 1

    reference = json.loads((loading.step_dir(tuned, 4) / loading.LORA_BASE).read_text())
    step = loading.step_dir(base, 8)
    reference["path"] = str(step)  # another checkpoint in its place: its checksum differs
    text = json.dumps(reference)
    checkpoint = loading.step_dir(tuned, 4)
    (checkpoint / loading.LORA_BASE).write_text(text)
    manifest = json.loads((checkpoint / loading.MANIFEST).read_text())
    manifest[loading.LORA_BASE] = {"bytes": len(text.encode()),
                                   "sha256": loading.sha256_of(checkpoint / loading.LORA_BASE)}
    (checkpoint / loading.MANIFEST).write_text(json.dumps(manifest))
    assert main(["generate", str(checkpoint), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert f"{step}, which has changed since" in err and err.count("\n") == 1


def test_lora_from_scratch_keeps_its_frozen_base_and_bf16_trains(tmp_path, tiny_corpus):
    config = gpt_config(tmp_path, tiny_corpus)
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), *TINY, "train.lora.r=2",
                 "train.precision=bf16"]) == 0
    step = loading.step_dir(run, 4)
    weights = load_file(step / loading.WEIGHTS)
    assert not any(".lora_" in n for n in weights)
    first = load_file(loading.step_dir(run, 2) / loading.WEIGHTS)
    assert all(torch.equal(first[n], w) for n, w in weights.items())  # frozen
    assert loading.load_checkpoint(run).model(torch.zeros(1, 3, dtype=torch.long)).isfinite().all()


DIE_AFTER_STEP_4 = """
import os, sys
import tformer.training.trainer as trainer
save = trainer.save_step_checkpoint
def save_then_die(run):
    save(run)
    if run.step == 4:
        os._exit(9)
trainer.save_step_checkpoint = save_then_die
from tformer.cli import main
main(sys.argv[1:])
"""


class Killed(BaseException):
    """Raised right after step 4's checkpoint: nothing of the run after the save happens."""


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> tuple[Path, Path]:
    """(config, base run): the tiny GPT the LoRA runs below start from, trained once."""
    tmp = tmp_path_factory.mktemp("lora-base")
    corpus = tmp / "tiny.txt"
    corpus.write_text(TINY_TEXT, encoding="utf-8")
    config = gpt_config(tmp, corpus)
    assert main(["train", str(config), "--out", str(tmp / "base"), *TINY]) == 0
    return config, tmp / "base"


@pytest.mark.parametrize("int8", [False, True])
def test_a_killed_and_resumed_lora_run_ends_as_an_uninterrupted_one(tmp_path, lora_base, int8,
                                                                    monkeypatch):
    # With train.lora.int8 the resumed run rounds its base again from the fp32 checkpoint.
    config, base = lora_base
    lora_run = [*TINY, "train.steps=6", "train.eval_every=3",
                f"train.init_from={base}", "train.lora.r=2", "train.lora.dropout=0.2",
                "model.dropout=0.1", "train.accumulate=2", f"train.lora.int8={str(int8).lower()}"]
    straight = tmp_path / "straight"
    assert main(["train", str(config), "--out", str(straight), *lora_run]) == 0
    killed = tmp_path / "killed"
    if not int8:  # a real kill: the process ends with no clean-up at all
        proc = subprocess.run([sys.executable, "-c", DIE_AFTER_STEP_4, "train", str(config),
                               "--out", str(killed), *lora_run], capture_output=True,
                              timeout=120)
        assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    else:  # the same stop in this process; the real kill is covered above
        save = trainer.save_step_checkpoint

        def save_then_die(run):
            save(run)
            if run.step == 4:
                raise Killed

        with monkeypatch.context() as patch:
            patch.setattr(trainer, "save_step_checkpoint", save_then_die)
            with pytest.raises(Killed):
                main(["train", str(config), "--out", str(killed), *lora_run])
    assert loading.step_checkpoints(killed)[-1].name == "step-000004"
    assert main(["train", "--resume", "--out", str(killed), "train.lora=none"]) == 2
    assert main(["train", "--resume", "--out", str(killed)]) == 0
    a = load_file(loading.step_dir(straight, 6) / loading.ADAPTERS)
    b = load_file(loading.step_dir(killed, 6) / loading.ADAPTERS)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = [[r.split(",")[:3] for r in (run / "metrics.csv").read_text().splitlines()]
            for run in (straight, killed)]
    assert rows[0] == rows[1]


@pytest.mark.parametrize("family", ["gpt", "seq2seq", "transformer-xl"])
def test_an_int8_base_keeps_every_block_linear_as_int8_and_trains_the_adapters(family):
    model, fp32 = tiny_model(family), tiny_model(family)  # eval(): no dropout to differ
    fp32.load_state_dict(model.state_dict())
    linears = lora.block_linears(model)
    torch.manual_seed(0)
    names = lora.add_adapters(model, LoRAConfig(r=2, targets=["out_proj"], int8=True))
    torch.manual_seed(0)
    assert lora.add_adapters(fp32, LoRAConfig(r=2, targets=["out_proj"])) == names
    for name in linears:  # adapted or not, no fp32 weight is left in the blocks
        layer = model.get_submodule(name)
        kind = lora.Int8LoRALinear if name in names else FrozenInt8Linear
        assert type(layer) is kind, name
        assert not any(n.endswith("weight") and "lora_" not in n
                       for n, _ in layer.named_parameters()), name
    held = {n: t for n, t in model.state_dict().items() if n.rsplit(".", 1)[0] in linears}
    assert all(n.endswith("bias") for n in held)
    # The same adapters draw the same numbers; the outputs differ by int8's rounding only.
    theirs = lora.adapter_state(fp32)
    assert all(torch.equal(t, theirs[n]) for n, t in lora.adapter_state(model).items())
    randomise_adapters(model)
    randomise_adapters(fp32)
    tokens = torch.randint(0, 23, (2, 8))
    out, want = forward(model, family, tokens), forward(fp32, family, tokens)
    assert (out - want).abs().max() < 0.05 * want.abs().max()
    out.square().mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)


def test_an_int8_lora_run_learns_and_loads_into_the_fp32_base(tmp_path, tiny_corpus, capsys):
    config = gpt_config(tmp_path, tiny_corpus)
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert main(["train", str(config), "--out", str(base), *TINY]) == 0
    int8 = [*TINY, "train.steps=12", "train.eval_every=12", "train.checkpoint_every=12",
            f"train.init_from={base}", "train.lora.r=4", "train.lora.int8=true"]
    capsys.readouterr()
    assert main(["train", str(config), "--out", str(tuned), *int8]) == 0
    step = loading.step_dir(tuned, 12)
    trained = sum(t.numel() for t in load_file(step / loading.ADAPTERS).values())
    every = trained + sum(p.numel() for p in loading.load_checkpoint(base).model.parameters())
    err = capsys.readouterr().err  # the int8 weights are counted
    assert f"lora    {trained:,} of {every:,} parameters train" in err and "in int8" in err
    # Trained on one batch over and over (in the run's config), its loss comes down as the
    # same adapters' over the fp32 base do.
    cfg = config_from_dict(json.loads((tuned / loading.CONFIG).read_text()))
    losses = {}
    for int8_base in (True, False):
        lora_cfg = dataclasses.replace(cfg.train.lora, int8=int8_base)
        run = start_run(cfg.replace("train", lora=lora_cfg), tmp_path / f"{int8_base}", None)
        run.batches = itertools.repeat(next(run.batches))
        with stop_requests() as stop:
            losses[int8_base] = [optimizer_step(run, stop).loss for _ in range(10)]
        adapters = {id(p) for n, p in run.model.named_parameters() if ".lora_" in n}
        assert {id(p) for g in run.optimizer.param_groups for p in g["params"]} == adapters
        assert {id(p) for p in run.optimizer.state} == adapters
    assert losses[True][-1] < losses[True][0] - 0.05, losses
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False], strict=True)) < 0.02, losses
    assert sorted(p.name for p in step.iterdir() if "safetensors" in p.name) == [
        loading.ADAPTERS]
    # Loaded, the adapters are merged into the fp32 base: no int8 layer is left.
    loaded = loading.load_checkpoint(step).model
    model = loading.load_checkpoint(base).model
    lora.add_adapters(model, LoRAConfig(r=4))
    lora.load_adapters(model, load_file(step / loading.ADAPTERS), step)
    lora.merge(model)
    assert not any(isinstance(m, FrozenInt8Linear) for m in loaded.modules())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert main(["evaluate", str(tuned), "--json"]) == 0


@pytest.mark.parametrize("change, message", [
    ([], "needs train.init_from"),
    (["train.init_from=somewhere", "train.precision=bf16"], "trains on the CPU in fp32"),
    (["train.init_from=somewhere", "train.device=cuda"], "trains on the CPU in fp32"),
    (["train.init_from=somewhere", "train.parallel=fsdp"], "choose train.parallel = ddp"),
])
def test_an_int8_base_is_refused_where_it_cannot_train(change, message):
    with pytest.raises(TformerError, match=message) as caught:
        config_from_dict({}, ["train.lora.int8=true", *change])
    assert "\n" not in str(caught.value)


def test_an_int8_base_off_the_cpu_is_a_one_line_error():
    model = tiny_model("gpt").to("meta")  # as train.device = auto would find a GPU
    with pytest.raises(TformerError, match="train.lora.int8 trains on the CPU.*on meta"):
        lora.add_adapters(model, LoRAConfig(int8=True))


def test_a_seq2seq_lora_trains_and_translates(tmp_path, capsys, monkeypatch):
    root = Path(__file__).resolve().parents[2]
    tiny = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.d_ff=32",
            "data.builtin_pairs=200", "data.builtin_max=999", "data.max_tokens=400",
            "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
            "train.warmup_steps=1", "train.log_every=1", "train.device=cpu"]
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    config = str(root / "configs" / "seq2seq-builtin.toml")
    assert main(["train", config, "--out", str(base), *tiny]) == 0
    assert main(["train", config, "--out", str(tuned), *tiny, f"train.init_from={base}",
                 "train.lora.r=2", "train.lora.targets=[\"q_proj\", \"kv_proj\"]",
                 "train.lr=1e-2"]) == 0
    adapters = load_file(loading.step_dir(tuned, 2) / loading.ADAPTERS)
    assert {n.split(".")[-3] for n in adapters} == {"q_proj", "kv_proj"}  # cross-attention
    assert any(w.abs().sum() > 0 for n, w in adapters.items() if "lora_B" in n)
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("12\n347\n"))
    assert main(["translate", str(tuned), "--beam", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("parallel, int8", [("ddp", False), ("fsdp", False), ("ddp", True)])
def test_two_processes_train_the_adapters_as_one(tmp_path, tiny_corpus, parallel, int8):
    config = gpt_config(tmp_path, tiny_corpus)
    base = tmp_path / "base"
    assert main(["train", str(config), "--out", str(base), *TINY]) == 0
    args = [*TINY, "train.batch_size=4", "train.accumulate=2", f"train.parallel={parallel}",
            f"train.init_from={base}", "train.lora.r=2", f"train.lora.int8={str(int8).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for out, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node=2"])):
        command = [sys.executable, *launcher, "-m", "tformer", "train", str(config), "--out",
                   str(tmp_path / out), *args]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(loading.step_dir(tmp_path / "one", 4) / loading.ADAPTERS)
    two = load_file(loading.step_dir(tmp_path / "two", 4) / loading.ADAPTERS)
    assert one.keys() == two.keys() and len(one) == 16
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=2e-5, rtol=1e-4, msg=name)
