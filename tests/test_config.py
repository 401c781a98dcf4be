import csv
import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer import loading
from tformer.config import config_from_dict, load_config, parse_override
from tformer.errors import TformerError
from tformer.training import checkpoint as ckpt
from tformer.training.trainer import train

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_builds_its_model_and_takes_a_training_step(path, tmp_path):
    cfg = load_config(path)
    assert cfg.to_dict()["model"]["family"] == cfg.family
    # The model as shipped; the data from the built-in corpus (fields naming files unset),
    # a tiny batch, and one step.
    files = [f.name for f in dataclasses.fields(cfg.data)
             if f.name in ("path", "val_path") or f.name.endswith(("_src", "_tgt"))]
    cfg = cfg.replace("data", **dict.fromkeys(files))
    if hasattr(cfg.data, "max_tokens"):  # batches by token count, of built-in pairs
        cfg = cfg.replace("data", max_tokens=200, builtin_pairs=300)
    cfg = cfg.replace("train", steps=1, eval_every=1, checkpoint_every=1, eval_batches=1,
                      warmup_steps=0, device="cpu", batch_size=2)
    result = train(cfg, tmp_path / "run")
    assert result.step == 1 and result.skipped_steps == 0
    state = ckpt.load_trainer_state(tmp_path / "run" / "checkpoints" / "step-000001")
    # Every parameter took part: the optimizer stepped once with a gradient for each.
    loaded = loading.load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000001")
    moments = state["optimizer"]["state"]
    assert len(moments) == len(list(loaded.model.parameters()))
    assert all(int(m["step"]) == 1 and m["exp_avg"].abs().sum() > 0 for m in moments.values())
    with open(tmp_path / "run" / "metrics.csv") as f:
        losses = {r["split"]: float(r["loss"]) for r in csv.DictReader(f)}
    assert set(losses) == {"train", "val"} and all(map(math.isfinite, losses.values()))


def test_overrides_are_typed_toml_values():
    assert parse_override("train.lr=3e-4") == ("train", "lr", 3e-4)
    assert parse_override("model.n_layer=6") == ("model", "n_layer", 6)
    assert parse_override("model.bias=false") == ("model", "bias", False)
    assert parse_override("data.path=corpus.txt") == ("data", "path", "corpus.txt")
    assert parse_override('data.path="a b.txt"') == ("data", "path", "a b.txt")


def test_overrides_apply_and_ints_become_floats():
    cfg = config_from_dict({}, ["model.n_layer=6", "train.lr=1", "data.path=none"])
    assert cfg.model.n_layer == 6
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.data.path is None


@pytest.mark.parametrize(
    "raw,overrides,message",
    [
        (
            {"model": {"n_layers": 4}},
            [],
            r'unknown key model.n_layers \(did you mean "n_layer"\?\)',
        ),
        ({}, ["trian.lr=1"], r"unknown table 'trian' \(did you mean \"train\"\?\)"),
        ({"modle": {}}, [], r'unknown table \[modle\] \(did you mean "model"\?\)'),
        ({}, ["lr=1"], "not of the form section.key=value"),
        ({}, ["train.lr=fast"], "train.lr = 'fast' has the wrong type; expected float"),
        ({}, ["model.n_layer=2.5"], "expected int"),
        ({}, ["model.bias=1"], "expected bool"),
        ({}, ["model.n_head=3"], "model.d_model = 128 is not divisible by model.n_head = 3"),
        ({}, ["model.n_layer=0"], "model.n_layer = 0 must be at least 1"),
        (
            {},
            ["model.norm=middle"],
            "model.norm = 'middle' is not allowed; choose one of: pre | post",
        ),
        (
            {},
            ["model.family=gtp"],
            "model.family = 'gtp' is not known \\(did you mean \"gpt\"\\?\\)",
        ),
        ({}, ["train.schedule=step"], "choose one of: cosine | linear | noam | constant"),
        ({}, ["train.min_lr=1"], "train.min_lr = 1.0 must be at most"),
        ({}, ["train.lr=nan"], "must be a finite number"),
        ({"train": 3}, [], r"\[train\] must be a table"),
    ],
)
def test_bad_configs_name_the_problem(raw, overrides, message):
    with pytest.raises(TformerError, match=message):
        config_from_dict(raw, overrides)


def test_config_file_errors(tmp_path):
    with pytest.raises(TformerError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nn_layer = ")
    with pytest.raises(TformerError, match="does not parse"):
        load_config(bad)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TformerError, match="not UTF-8"):
        load_config(binary)


def test_round_trip_through_dict():
    cfg = config_from_dict({}, ["model.n_layer=3", "data.tokenizer=bpe"])
    assert config_from_dict(cfg.to_dict()) == cfg


@given(
    st.dictionaries(
        st.sampled_from(["model", "data", "train", "x"]),
        st.dictionaries(
            st.text(max_size=12),
            st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none()),
            max_size=4,
        ),
        max_size=3,
    )
)
@settings(max_examples=300, deadline=None)
def test_no_config_gives_anything_but_a_clear_error(raw):
    raw = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in raw.items()}
    try:
        config_from_dict(raw)
    except TformerError as e:
        assert "\n" not in str(e)


@given(st.text(max_size=30))
@settings(max_examples=300, deadline=None)
def test_no_override_gives_anything_but_a_clear_error(text):
    try:
        config_from_dict({}, [text])
    except TformerError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("depth", [100, 100000])
def test_deep_nesting_is_one_line(tmp_path, depth):
    nested = "[" * depth + "]" * depth
    path = tmp_path / "deep.toml"
    path.write_text(f"[model]\nn_layer = {nested}\n")
    with pytest.raises(TformerError):
        load_config(path)
    inline = "{a = " * depth + "1" + "}" * depth
    path.write_text(f"[data]\npath = {inline}\n")
    with pytest.raises(TformerError):
        load_config(path)
    with pytest.raises(TformerError):
        config_from_dict({}, [f"model.n_layer={nested}"])
    json_path = tmp_path / "deep.json"
    json_path.write_text('{"model": ' + nested + "}")
    with pytest.raises(TformerError):
        load_config(json_path)


def test_without_the_registry_a_family_is_unknown_in_one_line():
    import subprocess
    import sys

    code = ("from tformer.config import config_from_dict\n"
            "from tformer.errors import TformerError\n"
            "try:\n    config_from_dict({})\n"
            "except TformerError as e:\n    print(e)\n")
    src = Path(__file__).resolve().parents[1] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(src)}).stdout
    assert out == ("model.family = 'gpt' is not known; choose one of: none registered "
                   "(import tformer.registry)\n")
