"""`tformer info`: parameter counts against the weights and against a count written out
by hand, the summary's parts, and the command's tables. (Its FLOPs and activation memory
are tests/viz/test_cost.py's.)"""

import json
import re

import pytest
from safetensors.torch import load_file

from tformer.cli import main
from tformer.config import config_from_dict
from tformer.errors import TformerError
from tformer.registry import get_family
from tformer.viz.info import parameters_by_module, summarize


def model_of(family, model):
    return get_family(family).model(config_from_dict({"model": {"family": family, **model}}).model)


def test_parameters_count_a_tied_embedding_once(runs):
    info = summarize(runs["seq2seq"])
    weights = load_file(str(runs["seq2seq"] / "best" / "model.safetensors"))
    # The file stores tied tensors once; its tensors' sizes are the distinct parameters.
    assert info["parameters"]["total"] == sum(t.numel() for t in weights.values())
    assert sum(info["parameters"]["by_module"].values()) == info["parameters"]["total"]
    assert "tgt_embed" not in info["parameters"]["by_module"]

    untied = model_of("seq2seq", {"vocab_size": 34, "max_len": 40, "n_layer": 1, "n_head": 2,
                                  "d_model": 32, "d_ff": 64, "tie_embeddings": False})
    by_module = parameters_by_module(untied)
    assert by_module["tgt_embed"] == by_module["src_embed"] == by_module["out_proj"] == 34 * 32


def test_parameters_of_a_llama_layout_match_a_count_by_hand():
    """Grouped-query attention with q/k/v biases and q/k norms, a head size apart from
    d_model / n_head, a gated feed-forward and RMSNorm: every tensor's size written out."""
    V, D, L, H, H_kv, dh, F = 50, 24, 2, 4, 2, 10, 40
    shape = {"vocab_size": V, "d_model": D, "n_layer": L, "n_head": H, "n_kv_head": H_kv,
             "d_head": dh, "d_ff": F, "feedforward": "gated", "activation": "silu",
             "norm_kind": "rmsnorm", "bias": False, "qkv_bias": True, "qk_norm": True,
             "rotary": True, "position": "none", "context": 16}
    q, kv = H * dh, H_kv * dh
    attention = D * q + 2 * D * kv + (q + 2 * kv) + q * D + 2 * dh  # weights, biases, norms
    layer = attention + 3 * D * F + 2 * D  # gate, up, down; two RMSNorm weights
    tied = V * D + L * layer + D  # the embedding (the output layer's too), the final norm
    model = model_of("gpt", shape)
    assert sum(parameters_by_module(model).values()) == tied == model.num_params()
    untied = parameters_by_module(model_of("gpt", {**shape, "tie_embeddings": False}))
    assert sum(untied.values()) == tied + V * D and untied["lm_head"] == V * D


def test_summary_holds_step_metrics_tokenizer_and_memory(runs):
    info = summarize(runs["seq2seq"])
    assert info["family"] == "seq2seq" and info["step"] == 6
    assert info["config"]["data.val_bleu_every"] == 1
    assert set(info["validation"]) == {"loss", "bleu", "chrf"}
    assert info["tokenizer"]["kind"] == "char"
    memory = info["memory_bytes"]
    assert memory["weights"] == 4 * info["parameters"]["total"]
    assert memory["optimizer_state"] == 2 * memory["weights"]
    assert memory["activations"] > 0
    assert info["flops_per_token"]["training"] > info["flops_per_token"]["decoding"] > 0


def test_the_command_prints_tables_or_json(runs, capsys):
    assert main(["info", str(runs["a"])]) == 0
    out = capsys.readouterr().out
    assert "parameters (shared tensors once)" in out and "FLOPs per token" in out
    assert main(["info", str(runs["a"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "gpt" and info["step"] == 12
    assert main(["info", "/no/such/run"]) == 2
    assert "not found" in capsys.readouterr().err


def test_the_cadence_options_are_checked():
    with pytest.raises(TformerError, match="data.val_bleu_every = -1 must be at least 0"):
        config_from_dict({"model": {"family": "seq2seq"}, "data": {"val_bleu_every": -1}})
    with pytest.raises(TformerError, match="train.patience = -2 must be at least 0"):
        config_from_dict({"model": {"family": "gpt"}, "train": {"patience": -2}})


def test_info_on_a_char_level_run_shows_the_fields_that_apply(runs, capsys):
    assert main(["info", str(runs["b"])]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split(None, 1)[1].strip()
            for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 1}
    assert rows["model.position"] == "learned" and rows["model.rotary"] == "False"
    assert "model.sinusoid_layout" not in rows  # learned positions
    assert not [key for key in rows if key.startswith("model.rope_")]  # no rotary
    # The run's own settings, the defaults left out; the tokenizer from the checkpoint.
    assert rows["train.lr"] == "0.003" and rows["train.steps"] == "12"
    assert "train.schedule" not in rows and "data.tokenizer" not in rows
    assert rows["kind"] == "char (characters)"
    assert re.search(r"^  chat template +none$", out, re.M), out
    info = summarize(runs["b"])
    assert info["tokenizer"]["kind"] == "char" and info["tokenizer"]["special"] == {}
    assert "model.rope_theta" not in info["config"]
