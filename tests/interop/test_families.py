"""Gemma 2, Gemma 3 (text) and Phi-3 as choices of the GPT decoder: tiny random models made
by transformers, saved, imported, and compared with transformers' own forward pass and
generate; cached decoding against the full pass; export back to a Hugging Face directory
and to a GGUF file, and transformers reading those."""

from __future__ import annotations

import os
from dataclasses import replace

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
    # A quarter of each head unrotated, untied embeddings, Phi-3-mini's sliding window.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75,
                                               "tie_word_embeddings": False,
                                               "sliding_window": 5}),
}


def build(path):
    """The model of a Hugging Face directory, by its family's importer."""
    from tformer.interop import gemma, phi3

    hf = read_hf_config(path)
    make = phi3.phi3_from_hf if hf["model_type"] == "phi3" else gemma.gemma_from_hf
    return make(hf, read_hf_weights(path), path)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained here, Gemma's turn markers among its specials, with a chat
    template (one for every family: training it is the slow part of a fixture)."""
    from tokenizers import decoders

    tokenizer = bpe_tokenizer(("<start_of_turn>", "<end_of_turn>"))
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()  # texts, not byte symbols
    tokenizer.chat_template = CHAT
    return tokenizer


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tokenizer, tmp_path_factory):
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
    tokenizer.save_pretrained(path)
    return request.param, path, model


CHAT = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
        "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma's chat template, in small."""
MESSAGES = [{"role": "user", "content": " Kalo mi ré? "}]
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


@torch.no_grad()
def test_greedy_tokens_match_hugging_face_generate(saved):
    name, path, hf = saved
    ours = build(path)
    prompt = torch.tensor([ROWS[0][:4]])
    expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[:, prompt.shape[1]:]
    got = torch.stack(list(generate(ours, prompt, max_new_tokens=12, temperature=0.0)), 1)
    assert torch.equal(got, expected), name


@torch.no_grad()
def test_cached_decoding_gives_the_full_pass_logits(saved):
    """A prompt then one token at a time through the KV cache (past the window, where the
    global layers read what the sliding ones no longer see), on the runner that decoding
    uses: the logits of one full pass over the same tokens."""
    from tformer.decoding.runner import runner

    name, path, _ = saved
    ours = build(path)
    tokens = torch.tensor([ROWS[0]])
    full = ours(tokens)
    run = runner(ours)
    cache = run.make_cache(1)
    steps = [run(tokens[:, :3], cache=cache)]
    steps += [run(tokens[:, i : i + 1], cache=cache) for i in range(3, tokens.shape[1])]
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5, name


def test_the_config_maps_each_family_difference(saved):
    name, path, _ = saved
    cfg = build(path).cfg
    gemma = name != "phi3"
    assert (cfg.norm_kind, cfg.sandwich_norm, cfg.scale_embeddings) == (
        ("rmsnorm_plus1", True, True) if gemma else ("rmsnorm", False, False))
    assert cfg.activation == ("gelu_tanh" if gemma else "silu")
    assert [cfg.slides(i) for i in range(cfg.n_layer)] == {
        "gemma2": [True, False], "gemma3": [True] * 5 + [False], "phi3": [True] * 2}[name]
    assert cfg.window == {"gemma2": 4, "gemma3": 3, "phi3": 5}[name]
    assert (cfg.attn_softcap, cfg.logit_softcap) == (
        (1.5, 2.0) if name == "gemma2" else (None, None))
    assert cfg.qk_norm == (name == "gemma3")
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == {
        "gemma2": (10000.0, None, "none"), "gemma3": (100000.0, 10000.0, "linear"),
        "phi3": (10000.0, None, "none")}[name]
    assert cfg.rope_fraction == (0.75 if name == "phi3" else 1.0)


def test_export_then_import_is_identical_and_transformers_reads_it(saved, tmp_path):
    from tformer.interop.command import choose_format, export_checkpoint, import_checkpoint
    from tformer.loading import load_checkpoint

    name, path, hf = saved
    run = import_checkpoint(path, tmp_path / "ours")
    fmt = {"gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}[name]
    out = export_checkpoint(run, tmp_path / "out", fmt)
    assert read_hf_config(out)["model_type"] == read_hf_config(path)["model_type"]
    theirs, back = read_hf_weights(path), read_hf_weights(out)
    if name != "phi3":
        theirs.pop("lm_head.weight", None)
    assert theirs.keys() == back.keys()
    for key, value in theirs.items():
        assert torch.equal(value, back[key]), key
    again = load_checkpoint(import_checkpoint(out, tmp_path / "again")).model
    first = load_checkpoint(run).model
    assert again.cfg == first.cfg
    reread = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([ROWS[0]])
    with torch.no_grad():
        assert (reread(tokens).logits - hf(tokens).logits).abs().max() <= 1e-5
    # A Gemma goes out as a Gemma by its config alone; Phi-3's layout is also Llama's.
    assert choose_format(run, tmp_path / "x")[1] == {
        "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}[name]


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma3"}, "multimodal Gemma 3 config.json without a text_config"),
    ({"hidden_activation": "gelu"}, "cannot express hidden_activation = gelu"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "are not every n-th layer"),
])
def test_what_gemma_import_cannot_express_is_named(change, message, tmp_path):
    from tformer.interop.gemma import gemma_config

    hf = {"model_type": "gemma2", **COMMON, "sliding_window": 4, **change}
    with pytest.raises(TformerError, match=message):
        gemma_config(hf, tmp_path)


# --- GGUF -----------------------------------------------------------------------------------

OVERRIDES = {  # what transformers' GGUF reader takes from its defaults, not the file
    "gemma2": {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
               "final_logit_softcapping": 2.0},
    "gemma3": {"query_pre_attn_scalar": 256, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75}, "sliding_window": 5},
}


@pytest.fixture(scope="module")
def through_gguf(saved, tmp_path_factory):
    """The family imported, exported by tformer as a GGUF file (f32), and imported again."""
    from tformer.interop.command import export_checkpoint, import_checkpoint

    name, path, _ = saved
    folder = tmp_path_factory.mktemp(f"{name}-gguf")
    run = import_checkpoint(path, folder / "ours")
    file = export_checkpoint(run, folder / f"{name}.gguf")
    return run, file, import_checkpoint(file, folder / "again")


@torch.no_grad()
def test_a_gguf_written_here_imports_to_the_same_model(saved, through_gguf):
    from tformer.interop.gguf import read_gguf
    from tformer.loading import load_checkpoint

    name, path, hf = saved
    run, file, again = through_gguf
    assert read_gguf(file).architecture == {"gemma3": "gemma3"}.get(name, name)
    first, second = load_checkpoint(run).model, load_checkpoint(again).model
    # GGUF's metadata holds float32: the epsilon comes back rounded to it
    assert replace(second.cfg, norm_eps=first.cfg.norm_eps) == first.cfg
    assert second.cfg.norm_eps == pytest.approx(first.cfg.norm_eps, rel=1e-6)
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key
    tokens = torch.tensor([ROWS[0]])
    assert (second(tokens) - hf(tokens).logits).abs().max() <= 1e-5


@torch.no_grad()
def test_transformers_reads_the_gguf_written_here(saved, through_gguf):
    name, path, hf = saved
    _, file, _ = through_gguf
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, **OVERRIDES[name]).eval()
    tokens = torch.tensor([ROWS[0]])
    assert (reference(tokens).logits - hf(tokens).logits).abs().max() <= 1e-5


@torch.no_grad()
def test_a_quantized_gguf_keeps_its_blocks_and_computes_as_transformers_reads_it(
        saved, through_gguf, tmp_path):
    """Exported with q8_0 matrices: imported, the projections hold the file's blocks (Phi-3's
    fused gate/up is split, so read into fp32), and dequantized they give the logits
    transformers computes from the same file."""
    from tformer.interop.command import export_checkpoint
    from tformer.interop.gguf import convert_gguf
    from tformer.kernels.blocks import BlockLinear
    from tformer.loading import load_checkpoint

    name, _, _ = saved
    run, _, _ = through_gguf
    file = export_checkpoint(run, tmp_path / f"{name}-q8.gguf", "gguf", type="q8_0")
    kept, _ = convert_gguf(file, tmp_path / "run")
    assert set(kept) == {"Q8_0"}
    held = load_checkpoint(tmp_path / "run").model
    for block in held.blocks:  # (rows of 40 or 48 values go out as f16: not whole blocks)
        assert type(block.attn.qkv_proj) is BlockLinear
        assert (type(block.ff.gate) is BlockLinear) == (name != "phi3")
    ours = load_checkpoint(tmp_path / "run", weights="fp32").model
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, **OVERRIDES[name]).eval()
    tokens = torch.tensor([ROWS[0]])
    assert (ours(tokens) - reference(tokens).logits).abs().max() <= 1e-5
    # The blocks as held compute with their activations rounded to 8 bits, as llama.cpp's
    # q8_0 products do: near the dequantized weights' logits, not equal to them.
    assert (held(tokens) - ours(tokens)).abs().max() <= 0.05


def gguf_metadata(arch: str, **keys):
    """A GGUF file's metadata alone (no tensor is read to map the config)."""
    from pathlib import Path

    from tformer.interop.gguf import GGUFFile

    base = {"block_count": 2, "context_length": 64, "embedding_length": 256,
            "feed_forward_length": 512, "attention.head_count": 4,
            "attention.head_count_kv": 2, "vocab_size": 300}
    metadata = {"general.architecture": arch,
                **{f"{arch}.{k}": v for k, v in (base | keys).items()}}
    return GGUFFile(Path(f"{arch}.gguf"), metadata, {})


@pytest.mark.parametrize("arch,layers,expected", [
    ("gemma2", 42, 128), ("gemma2", 46, 144), ("gemma3", 34, 128), ("gemma3", 62, 168)])
def test_a_gemma_gguf_without_a_query_scale_takes_llama_cpps(arch, layers, expected):
    """Gemma 2 and 3's 27B models scale queries by d_model / n_head, not their head size;
    llama.cpp knows them by their layer count, and so does the import."""
    from tformer.interop.gguf import hf_config

    heads = 32
    hf = hf_config(gguf_metadata(arch, block_count=layers, embedding_length=expected * heads,
                                 **{"attention.head_count": heads,
                                    "attention.key_length": 128}))
    assert hf["query_pre_attn_scalar"] == expected
    every = 6 if arch == "gemma3" else 2
    assert hf["layer_types"][:every] == ["sliding_attention"] * (every - 1) + ["full_attention"]


def test_a_phi3_gguf_reads_its_partial_rotary_and_refuses_longrope():
    from tformer.interop.gguf import hf_config

    # llama.cpp writes no key_length for phi3: the head is d_model / n_head, 64 here
    hf = hf_config(gguf_metadata("phi3", **{"rope.dimension_count": 48}))
    assert (hf["head_dim"], hf["partial_rotary_factor"]) == (64, 0.75)
    file = gguf_metadata("phi3")
    file.tensors["rope_factors_long.weight"] = None
    with pytest.raises(TformerError, match="LongRoPE"):
        hf_config(file)


def test_greedy_text_and_the_chat_template_come_through_import_and_both_exports(
        saved, through_gguf, tmp_path):
    """tformer.load's greedy text is transformers' decoded greedy continuation; the chat
    template renders as transformers' apply_chat_template of the source does, from the
    imported checkpoint, from its GGUF file imported again, and from the exported folder."""
    import tformer
    from tformer.data.chat import load_chat_template
    from tformer.interop.command import export_checkpoint

    name, path, hf = saved
    run, _, again = through_gguf
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = torch.tensor([tokenizer("Kalo mi")["input_ids"]])
    with torch.no_grad():
        ids = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          eos_token_id=1)[0, prompt.shape[1]:]
    want = tokenizer.decode(ids, skip_special_tokens=True)
    for checkpoint in (run, again):
        assert tformer.load(checkpoint, threads=1).generate(
            "Kalo mi", max_new_tokens=12, temperature=0.0) == want, (name, checkpoint)

    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=True)
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for checkpoint in (run, again):
        assert load_chat_template(checkpoint, None, specials).render(MESSAGES) == rendered
    out = export_checkpoint(run, tmp_path / "out", "phi3" if name == "phi3" else "gemma")
    assert transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True) == rendered


def test_the_4x_config_form_reads_as_the_5x_one(saved):
    """transformers 4.x wrote no layer_types (a pattern, or Gemma's default one), Gemma
    3's rotary bases as rope_theta, rope_scaling and rope_local_base_freq, and Phi-3's
    partial rotary factor beside rope_theta."""
    from tformer.interop.gemma import gemma_config
    from tformer.interop.phi3 import phi3_config

    name, path, _ = saved
    hf = read_hf_config(path)
    if name == "phi3":
        params = hf["rope_parameters"]
        old = {key: value for key, value in hf.items() if key != "rope_parameters"}
        old |= {"rope_theta": params["rope_theta"],
                "partial_rotary_factor": params["partial_rotary_factor"]}
        assert phi3_config(old, path) == phi3_config(hf, path)
        return
    old = {key: value for key, value in hf.items()
           if key not in ("layer_types", "rope_parameters")}
    params = hf["rope_parameters"]
    if name == "gemma3":
        full = dict(params["full_attention"])
        old |= {"rope_theta": full.pop("rope_theta"),
                "rope_local_base_freq": params["sliding_attention"]["rope_theta"],
                "rope_scaling": full}
    else:
        old["rope_theta"] = params["rope_theta"]
    assert gemma_config(old, path) == gemma_config(hf, path)


REFUSED = {  # family -> (config.json changes, words of the error), each a one-line error
    "gemma2": [({"layer_types": ["full_attention", "sliding_attention"]},
                "not every n-th layer"),
               ({"hidden_activation": "relu"}, "hidden_activation = relu")],
    "gemma3": [({"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        "rope scaling on the sliding layers ('linear') cannot be expressed")],
    "phi3": [({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                   "short_factor": [1.0], "long_factor": [2.0]}},
              "rope type 'longrope' cannot be expressed")],
}


def test_what_cannot_be_imported_is_a_one_line_cli_error(saved, tmp_path, capsys):
    import json
    import shutil

    from tformer.cli import main

    name, path, _ = saved
    for i, (change, words) in enumerate(REFUSED[name]):
        source = tmp_path / f"source{i}"
        shutil.copytree(path, source)
        (source / "config.json").write_text(json.dumps(read_hf_config(source) | change))
        assert main(["import", str(source), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tformer: error: ") and err.count("\n") == 1, err
        assert words in err, err
        assert not (tmp_path / "run").exists()


@torch.no_grad()
def test_a_multimodal_gemma3_comes_in_as_its_text_model(tokenizer, tmp_path, caplog):
    """Gemma3ForConditionalGeneration (every Gemma 3 from 4B up): the text model imported,
    the vision tower and projector left out with a warning; on text it gives the logits of
    the whole model, whose config leaves most text fields to their defaults."""
    import json

    from tformer.interop.command import import_checkpoint
    from tformer.loading import load_checkpoint

    # The fields the published text_configs name; the rest (4 key/value heads, the query
    # scalar, the rotary bases, the window pattern, eps, context) are the defaults
    named = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 40,
             "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
             "sliding_window": 3}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=named, vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise(model)
    source = tmp_path / "source"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    hf = read_hf_config(source)
    (source / "config.json").write_text(json.dumps(hf | {"text_config": named | {
        "model_type": "gemma3_text"}}))
    with caplog.at_level("WARNING"):
        run = import_checkpoint(source, tmp_path / "ours")
    assert "vision tower and projector" in caplog.text
    ours = load_checkpoint(run).model
    assert ours.cfg.qk_norm and ours.cfg.context == 131072  # a default of the text config
    tokens = torch.tensor([ROWS[0]])
    assert (ours(tokens) - model(tokens).logits).abs().max() <= 1e-5
