"""YaRN's rotary scaling against transformers: its frequencies and attention factor from
transformers' own rope initialisation, and a tiny Qwen3 with yarn imported, its logits on a
sequence past the original context."""

from __future__ import annotations

import pytest
import torch

from tformer.interop.llama import hf_config, llama_from_hf
from tformer.layers.rotary import Rotary, RotaryScaling, inverse_frequencies

transformers = pytest.importorskip("transformers")

YARNS = [
    {"factor": 4.0, "original_max_position_embeddings": 16},
    # gpt-oss's form: no truncation of the ramp's ends
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.5},
]


def qwen3(yarn: dict, head_dim: int = 16):
    return transformers.Qwen3Config(
        vocab_size=120, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", **yarn}, attn_implementation="eager")


@pytest.mark.parametrize("yarn", YARNS)
def test_frequencies_and_attention_factor_are_transformers(yarn):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = qwen3(yarn, head_dim=64)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = RotaryScaling("yarn", yarn["factor"],
                            original_context=yarn["original_max_position_embeddings"],
                            beta_fast=yarn.get("beta_fast", 32.0),
                            beta_slow=yarn.get("beta_slow", 1.0),
                            truncate=yarn.get("truncate", True),
                            attention_factor=yarn.get("attention_factor"))
    got = inverse_frequencies(64, 10000.0, scaling)
    assert torch.allclose(got.float(), expected, rtol=1e-6)
    assert scaling.cos_sin_factor == pytest.approx(factor, rel=1e-12)
    # The ramp does blend: some pairs kept, some divided by the factor, some between.
    plain = inverse_frequencies(64, 10000.0, RotaryScaling())
    ratio = (plain / got).tolist()
    assert min(ratio) == pytest.approx(1.0) and max(ratio) == pytest.approx(yarn["factor"])
    assert any(1.01 < r < yarn["factor"] - 0.01 for r in ratio)
    cos, _ = Rotary(64, scaling=scaling).cos_sin(torch.zeros(1), torch.float32)
    assert torch.allclose(cos, torch.full_like(cos, factor))


@torch.no_grad()
def test_a_qwen3_with_yarn_gives_transformers_logits_past_its_original_context():
    config = qwen3(YARNS[0])
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.rand(p.shape) - 0.5
            p.copy_(1.0 + 0.4 * noise if "norm" in name else 0.4 * noise)
    ours = llama_from_hf(config.to_dict(), hf.state_dict(), "qwen3-yarn")
    assert (ours.cfg.rope_scaling, ours.cfg.rope_original_context) == ("yarn", 16)
    tokens = torch.randint(0, 120, (1, 40))  # 2.5 times the original context
    expected = hf(tokens).logits
    assert (ours(tokens) - expected).abs().max() <= 1e-5
    cache = ours.make_cache(1)
    steps = [ours(tokens[:, :20], cache=cache)]
    steps += [ours(tokens[:, i : i + 1], cache=cache) for i in range(20, 40)]
    assert (torch.cat(steps, 1) - expected).abs().max() <= 1e-5
    # generate's runner (the one-call step kernel where it serves) rotates the same way:
    # greedy tokens as transformers' full forward pass picks them, one at a time.
    from tformer.decoding.lm import generate

    seq = tokens[:, :12]
    for _ in range(30):
        seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], 1)
    got = torch.stack(list(generate(ours, tokens[:, :12], max_new_tokens=30,
                                    temperature=0.0)), 1)
    assert torch.equal(got, seq[:, 12:])
    written = hf_config(ours.cfg)["rope_parameters"]
    assert {k: written[k] for k in ("rope_type", "factor", "original_max_position_embeddings",
                                    "beta_fast", "beta_slow", "truncate")} == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    again = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{
        **hf_config(ours.cfg), "attn_implementation": "eager"})).eval()
    again.load_state_dict(hf.state_dict())
    assert torch.equal(again(tokens).logits, expected)
