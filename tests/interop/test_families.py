"""Gemma 2, Gemma 3 (text) and Phi-3 as choices of the GPT decoder: tiny random models made
by transformers, saved, imported, and compared with transformers' own forward pass and
generate; cached decoding against the full pass; export back to a Hugging Face directory
and to a GGUF file, and transformers reading those."""

from __future__ import annotations

import os

import pytest
import torch

from tformer.decoding.lm import generate, left_pad
from tformer.errors import TformerError
from tformer.interop import read_hf_config, read_hf_weights

from .test_llama import bpe_tokenizer, randomise

transformers = pytest.importorskip("transformers")
os.environ.setdefault("TQDM_DISABLE", "1")

COMMON = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1}
FAMILIES = {
    # Soft caps small enough to bend these logits and scores, a window shorter than the
    # rows, a query scalar that is not the head size.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}),
    # Six layers: five slide (base 10,000), the sixth is global (base 100,000, scaled).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 12, "num_hidden_layers": 6, "sliding_window": 3,
        "query_pre_attn_scalar": 256, "rope_theta": 100000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # A quarter of each head unrotated, untied embeddings.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75,
                                               "tie_word_embeddings": False}),
}


def build(path):
    from tformer.interop import gemma, phi3

    hf = read_hf_config(path)
    make = phi3.phi3_from_hf if hf["model_type"] == "phi3" else gemma.gemma_from_hf
    return make(hf, read_hf_weights(path), path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    config_class, model_class, fields = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model)
    if request.param != "phi3":  # Gemma's norms hold offsets from 1: around 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return request.param, path, model


ROWS = [[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54], [12, 6, 90], [33, 2, 71, 45, 8, 19, 60]]


@torch.no_grad()
def test_logits_match_hugging_face(saved):
    name, path, hf = saved
    ours = build(path)
    tokens, is_real = left_pad(ROWS, pad_id=0)
    got = ours(tokens, is_real)
    for i, row in enumerate(ROWS):
        expected = hf(torch.tensor([row])).logits[0]
        delta = (got[i][is_real[i]] - expected).abs().max()
        assert delta <= 1e-5, (name, float(delta))
