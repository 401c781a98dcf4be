"""Checkpoints that are wrong in ways a checksum cannot see (the manifest was rewritten to
match them, or they belong to another run), non-finite values, and what readers and
`--resume` make of them: one line, and nothing overwritten."""

import json
import math

import pytest
import torch
from safetensors.torch import save_model

from tformer import loading
from tformer.cli import main
from tformer.cli.common import print_metrics
from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.decoding.sampling import next_token
from tformer.errors import TformerError
from tformer.registry import get_family
from tformer.tasks.gpt import GPTTask
from tformer.training import checkpoint as ckpt
from tformer.training.run import resume_point


@pytest.fixture
def run(tmp_path, tiny_config):
    config = tiny_config()
    out = tmp_path / "run"
    assert main(["train", str(config), "--out", str(out)]) == 0
    return out


def files_of(run_dir):
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ckpt.LOCK
    }


def rewrite_manifest(path):
    """What a careless tool would do: make the manifest agree with whatever is there."""
    manifest = {
        p.name: {"bytes": p.stat().st_size, "sha256": loading.sha256_of(p)}
        for p in sorted(path.iterdir())
        if p.name != loading.MANIFEST
    }
    (path / loading.MANIFEST).write_text(json.dumps(manifest))


def plant(run_dir, step, cfg, tokenizer):
    """Another model's checkpoint, saved among the run's step checkpoints."""
    model = get_family(cfg.family).model(cfg.model)
    return ckpt.save_checkpoint(loading.step_dir(run_dir, step), cfg, model, tokenizer,
                                {"step": step})


# --- another family's, or another shape's, checkpoint in a run -----------------------------


@pytest.mark.parametrize(
    "model,message",
    [
        (["model.family=seq2seq", "model.n_layer=1", "model.d_model=16", "model.n_head=2"],
         "is a seq2seq checkpoint but"),
        (["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16"],
         "does not fit the run's config"),
    ],
    ids=["family", "shape"],
)
def test_resume_refuses_a_foreign_checkpoint_and_changes_nothing(run, capsys, model, message):
    loaded = loading.load_checkpoint(run)
    cfg = config_from_dict({}, [*model, f"model.vocab_size={loaded.tokenizer.vocab_size}"])
    plant(run, 99, cfg, loaded.tokenizer)
    before = files_of(run)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err and "step-000099" in err and err.count("\n") == 1
    assert files_of(run) == before, "nothing was overwritten"


# --- damage a checksum cannot see --------------------------------------------------------


@pytest.mark.parametrize(
    "manifest",
    [
        [],
        {"model.safetensors": "x"},
        {"config.json": {"bytes": "12", "sha256": "0"}},
        {"config.json": {"bytes": 12, "sha256": None}},
        {"../config.json": {"bytes": 12, "sha256": "0"}},
        "null",
    ],
)
def test_a_manifest_of_the_wrong_shape_is_named(run, manifest, capsys):
    best = (run / "best").resolve()
    (best / loading.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TformerError, match="manifest.json is damaged"):
        loading.load_checkpoint(best)
    # From the run directory, the reader falls back to a good step checkpoint.
    assert loading.load_checkpoint(run).path.name.startswith("step-")


def test_a_damaged_safetensors_header_is_named(run):
    best = (run / "best").resolve()
    data = bytearray((best / loading.WEIGHTS).read_bytes())
    data[8:20] = b"not json at!"
    (best / loading.WEIGHTS).write_bytes(bytes(data))
    rewrite_manifest(best)
    with pytest.raises(TformerError, match="model.safetensors is damaged"):
        loading.load_checkpoint(best)


def test_tensors_of_the_wrong_shape_are_named(run):
    best = (run / "best").resolve()
    cfg = loading.read_config(best)
    wider = get_family("gpt").model(cfg.replace("model", d_model=32).model)
    save_model(wider, str(best / loading.WEIGHTS))
    rewrite_manifest(best)
    with pytest.raises(TformerError, match=r"has shape \[.*32.*\], its config says"):
        loading.load_checkpoint(best)
    assert main(["generate", str(best), "--max-new-tokens", "2"]) == 2


def test_a_missing_tensor_is_named(run):
    best = (run / "best").resolve()
    cfg = loading.read_config(best)
    deeper = get_family("gpt").model(cfg.replace("model", n_layer=cfg.model.n_layer + 1).model)
    model = get_family("gpt").model(cfg.model)
    save_model(model, str(best / loading.WEIGHTS))
    rewrite_manifest(best)
    loading.load_checkpoint(best)  # complete: loads
    # The checkpoint as the config of a deeper model reads it: a whole layer is missing.
    with pytest.raises(TformerError, match=r"lacks blocks\.\d+\..*, a tensor of its config"):
        loading.check_weight_shapes(best, deeper)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_resume_falls_back_past_a_trainer_state_that_does_not_load(run, damage):
    newest = loading.step_checkpoints(run)[-1]
    state = newest / loading.TRAINER_STATE
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x80" * len(data))
    rewrite_manifest(newest)  # the checksum passes: only loading can tell
    assert resume_point(run).name == "step-000003"
    assert main(["train", "--resume", "--out", str(run), "train.steps=9"]) == 0
    assert loading.step_checkpoints(run)[-1].name == "step-000009"


# --- non-finite values -----------------------------------------------------------------


def test_a_nan_validation_loss_never_becomes_best(tmp_path, tiny_config, monkeypatch):
    real = GPTTask.evaluate
    calls = {"n": 0}

    def nan_first(self, model, **kwargs):
        calls["n"] += 1
        result = real(self, model, **kwargs)
        return {k: math.nan for k in result} if calls["n"] == 1 else result

    monkeypatch.setattr(GPTTask, "evaluate", nan_first)
    config = tiny_config()
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), "train.steps=3"]) == 0
    assert not (run / "best").exists(), "the only evaluation was NaN"
    assert main(["train", "--resume", "--out", str(run), "train.steps=6"]) == 0
    assert (run / "best").exists(), "the first finite one is best"


def test_non_finite_weights_are_one_line(run, capsys):
    best = (run / "best").resolve()
    loaded = loading.load_checkpoint(best)
    with torch.no_grad():
        loaded.model.lm_head.weight[0, 0] = math.nan
    ckpt.save_checkpoint(best, loaded.cfg, loaded.model, loaded.tokenizer)
    capsys.readouterr()
    assert main(["generate", str(best), "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "non-finite weights" in err and err.count("\n") == 1


def test_non_finite_logits_are_one_line():
    logits = torch.tensor([[0.0, math.nan, 1.0]])
    for temperature in (0.0, 1.0):
        with pytest.raises(TformerError, match="outputs are not finite"):
            next_token(logits, temperature=temperature)


def test_a_non_finite_evaluation_is_one_line(run, capsys, monkeypatch):
    from tformer.tasks import gpt

    monkeypatch.setattr(gpt, "evaluate_text", lambda *args, **kwargs: {"loss": math.nan})
    capsys.readouterr()
    assert main(["evaluate", str(run), "--json"]) == 2
    err = capsys.readouterr().err
    assert "non-finite outputs" in err and err.count("\n") == 1


def test_json_output_is_strict(capsys):
    print_metrics({"loss": 800.0, "perplexity": math.inf, "bpc": 1154.2}, as_json=True)
    out = capsys.readouterr().out

    def reject(constant):
        raise AssertionError(f"not strict JSON: {constant}")

    parsed = json.loads(out, parse_constant=reject)
    assert parsed["perplexity"] is None and parsed["loss"] == 800.0
    assert "inf" in parsed["non_finite"]["perplexity"]


def test_save_failure_removes_its_temporary(tmp_path, monkeypatch):
    tok = CharTokenizer("abc")
    cfg = config_from_dict({}, ["model.n_layer=1", "model.d_model=16", "model.n_head=2",
                                f"model.vocab_size={tok.vocab_size}"])
    model = get_family("gpt").model(cfg.model)
    good = ckpt.save_checkpoint(loading.step_dir(tmp_path, 1), cfg, model, tok, {"step": 1})

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(TformerError, match="cannot save checkpoint .*step-000002"):
        ckpt.save_checkpoint(loading.step_dir(tmp_path, 2), cfg, model, tok, {"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]
    loading.verify_checkpoint(good)
