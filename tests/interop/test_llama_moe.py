"""Qwen3-MoE, Qwen2-MoE and Mixtral from Hugging Face: tiny random models made by transformers,
saved, imported, and compared with transformers' forward, generate and router token by
token; then exported back, every tensor bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tformer.decoding.lm import generate, left_pad
from tformer.errors import TformerError
from tformer.interop import read_hf_config, read_hf_weights
from tformer.interop.llama import llama_config, llama_from_hf

from .test_llama import randomise

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "num_experts_per_tok": 2, "tie_word_embeddings": False}
QWEN = {"intermediate_size": 40, "num_experts": 6, "moe_intermediate_size": 24}
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**QWEN, "head_dim": 12,
                                                           "norm_topk_prob": True}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **QWEN, "shared_expert_intermediate_size": 20, "norm_topk_prob": False}),
    # Mixtral's experts are intermediate_size wide; a window as long as the context.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "intermediate_size": 24, "num_local_experts": 6, "sliding_window": 64}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    config_class, model_class, fields = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**COMMON, **fields,
                                                 attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model)
    with torch.no_grad():  # routers sharp enough that tokens spread over the experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model, imported(path)


def imported(path):
    return llama_from_hf(read_hf_config(path), read_hf_weights(path), path)


ROWS = [[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54], [12, 6, 90], [33, 2, 71, 45, 8, 19, 60]]


@torch.no_grad()
def test_logits_match_hugging_face_on_a_left_padded_batch(saved):
    name, _, hf, ours = saved
    tokens, is_real = left_pad(ROWS, pad_id=0)
    got = ours(tokens, is_real)
    for i, row in enumerate(ROWS):
        expected = hf(torch.tensor([row])).logits[0]
        assert (got[i][is_real[i]] - expected).abs().max() <= 1e-5, name


@torch.no_grad()
def test_each_token_goes_to_the_experts_hugging_face_chooses(saved):
    """Hugging Face's router hooked, layer by layer: the same experts, in the same order."""
    name, _, hf, ours = saved
    theirs, mine = {}, {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, i, out, n=n: theirs.__setitem__(n, out[2])) for n, layer in
        enumerate(hf.model.layers)]
    hooks += [block.ff.router.register_forward_hook(
        lambda m, i, out, n=n: mine.__setitem__(n, out[0])) for n, block in
        enumerate(ours.blocks)]
    tokens = torch.tensor([ROWS[0] + ROWS[2]])
    hf(tokens)
    ours(tokens)
    for hook in hooks:
        hook.remove()
    assert len(theirs) == len(mine) == 2
    for n in theirs:
        assert torch.equal(mine[n], theirs[n]), (name, n)
    # The random routers do spread the tokens: most experts are chosen somewhere.
    assert len({(n, e) for n in theirs for e in theirs[n].flatten().tolist()}) >= 6, theirs


@torch.no_grad()
def test_greedy_tokens_match_hugging_face_generate(saved):
    name, _, hf, ours = saved
    prompt = torch.tensor([ROWS[0][:4]])
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[:, prompt.shape[1]:]
    got = torch.stack(list(generate(ours, prompt, max_new_tokens=20, temperature=0.0)), 1)
    assert torch.equal(got, expected), name


@torch.no_grad()
def test_cached_decoding_equals_the_full_pass(saved):
    _, _, _, ours = saved
    tokens = torch.tensor([ROWS[2]])
    cache = ours.make_cache(1)
    steps = [ours(tokens[:, :3], cache=cache)]
    steps += [ours(tokens[:, i : i + 1], cache=cache) for i in range(3, tokens.shape[1])]
    assert (torch.cat(steps, 1) - ours(tokens)).abs().max() < 1e-5


def test_the_config_maps_the_mixture(saved):
    name, path, hf, ours = saved
    cfg = ours.cfg
    assert (cfg.n_expert, cfg.n_expert_active, cfg.d_ff) == (6, 2, 24)
    assert cfg.router_renormalise == (name in ("qwen3-moe", "mixtral"))
    assert cfg.d_shared_expert == (20 if name == "qwen2-moe" else 0)
    assert cfg.qk_norm == (name == "qwen3-moe") and bool(cfg.qkv_bias) == (name == "qwen2-moe")
    # transformers' own state_dict() holds the experts fused (gate_up_proj): the same model.
    again = llama_from_hf(hf.config.to_dict(), hf.state_dict(), path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 ours.state_dict().values(), strict=True))


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "dense feed-forward layers among the experts'"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
    ({"num_experts_per_tok": None}, "has no num_experts_per_tok"),
])
def test_what_a_mixture_cannot_express_is_named(saved, change, message):
    _, path, _, _ = saved
    with pytest.raises(TformerError, match=message):
        llama_config(read_hf_config(path) | change, path)


@pytest.fixture(scope="module")
def checkpoint(saved, tmp_path_factory):
    """The saved model with a tokenizer, imported through the CLI's command."""
    from tformer.interop.command import import_checkpoint

    from .test_llama import bpe_tokenizer

    name, _, hf, _ = saved
    source = tmp_path_factory.mktemp(f"{name}-source")
    hf.save_pretrained(source)
    bpe_tokenizer().save_pretrained(source)
    return import_checkpoint(source, tmp_path_factory.mktemp(f"{name}-ours") / "run")


def test_import_and_export_round_trip_through_the_cli_commands(saved, checkpoint, tmp_path):
    """Imported with a tokenizer, loaded as decoding loads it, exported: transformers reads
    back the same class and every tensor bit for bit."""
    from tformer.interop.command import export_checkpoint
    from tformer.loading import load_checkpoint

    name, _, hf, _ = saved
    loaded = load_checkpoint(checkpoint)
    prompt = torch.tensor([loaded.tokenizer.encode("Kalo mi")])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[:, prompt.shape[1]:]
        got = torch.stack(list(generate(loaded.model, prompt, max_new_tokens=12,
                                        temperature=0.0)), 1)
    assert torch.equal(got, expected), name

    back = export_checkpoint(checkpoint, tmp_path / "back", "llama")
    again = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(again) is type(hf)
    theirs, ours = hf.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs), name
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "shared_expert_intermediate_size"):
        assert getattr(again.config, key, None) == getattr(hf.config, key, None), key


def test_a_gguf_written_from_it_reads_back_the_same_in_transformers_and_here(
        saved, checkpoint, tmp_path):
    """Exported as GGUF (qwen2moe / qwen3moe, experts stacked as ffn_*_exps): transformers'
    GGUF reader gives the original's logits, and importing it again every tensor."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from tformer.interop.command import export_checkpoint
    from tformer.interop.gguf import import_gguf, read_gguf

    name, _, hf, ours = saved
    out = export_checkpoint(checkpoint, tmp_path / "model.gguf", "gguf")
    file = read_gguf(out)
    assert file.architecture == {"mixtral": "llama"}.get(name, name.replace("-", ""))
    assert file.tensors["blk.0.ffn_gate_exps.weight"].shape == (6, 24, 32)
    back = import_gguf(out, tmp_path / "back")
    before, after = ours.state_dict(), load_file(back / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(after[k], before[k]) for k in before), name
    if name == "mixtral":
        return  # transformers reads a llama file as LlamaForCausalLM, experts or not
    tokens = torch.tensor([ROWS[0]])
    # transformers' GGUF reader takes the tensors from the file but not every expert key
    # (it reads no expert_feed_forward_length): the config comes from the original.
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        out.parent, gguf_file=out.name, config=hf.config, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reference(tokens).logits - hf(tokens).logits).abs().max() <= 1e-5


def test_a_gguf_file_s_expert_blocks_are_kept_as_blocks(saved, checkpoint, tmp_path):
    """A q8_0 export holds each stack of experts as Q8_0 blocks (routers in F32). Imported,
    expert e holds the file's blocks of expert e byte for byte (the projections whose rows
    are not whole blocks, f16 in the file, in fp32); the model computes with them, and goes
    out again as GGUF with the same bytes and as a Hugging Face folder."""
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    from tformer.interop.command import export_checkpoint
    from tformer.interop.gguf import convert_gguf, read_gguf
    from tformer.kernels.blocks import BlockLinear
    from tformer.loading import load_checkpoint, stored_formats

    name, _, hf, _ = saved
    out = export_checkpoint(checkpoint, tmp_path / "model.gguf", "gguf", type="q8_0")
    file = read_gguf(out)
    stack = file.tensors["blk.1.ffn_gate_exps.weight"]
    assert (stack.type, file.tensors["blk.1.ffn_gate_inp.weight"].type) == ("Q8_0", "F32")
    assert file.tensors["blk.1.ffn_down_exps.weight"].type == "F16"  # rows of 24: no blocks
    kept, dequantized = convert_gguf(out, tmp_path / "run")
    # Every Q8_0 tensor stays blocks, the embedding table too (its lookups decode rows).
    assert kept["Q8_0"] == sum(t.type == "Q8_0" for t in file.tensors.values())
    assert "Q8_0" not in dequantized
    assert stored_formats(tmp_path / "run")["blocks.1.ff.experts.gate.4.weight"] == "q8_0"
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        held = f.get_tensor("blocks.1.ff.experts.gate.4.weight")
    assert torch.equal(held, torch.from_numpy(np.array(stack.data[4])))

    model = load_checkpoint(tmp_path / "run").model
    experts = model.blocks[1].ff.experts
    assert type(experts.gate[4]) is BlockLinear and type(experts.down[4]) is torch.nn.Linear
    tokens = torch.tensor([ROWS[0]])
    with torch.no_grad():
        expected, got = hf(tokens).logits, model(tokens)
    assert (got - expected).norm() / expected.norm() < 0.03  # q8_0 weights and activations

    again = export_checkpoint(tmp_path / "run", tmp_path / "again.gguf", "gguf", type="q8_0")
    assert np.array_equal(read_gguf(again).tensors["blk.1.ffn_gate_exps.weight"].data,
                          stack.data)
    folder = export_checkpoint(tmp_path / "run", tmp_path / "folder", "llama")
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    whole = gguf.quants.dequantize(stack.data, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(back.model.layers[1].mlp.experts.gate_up_proj[4, :24],
                       torch.from_numpy(np.asarray(whole[4], dtype=np.float32)))


def test_training_starts_from_a_checkpoint_of_expert_blocks(saved, checkpoint, tmp_path):
    """train.init_from's reading of a GGUF import: the experts' blocks come back stacked in
    fp32 (their dequantized values), and they train."""
    pytest.importorskip("gguf")
    from tformer.interop.command import export_checkpoint
    from tformer.interop.gguf import import_gguf
    from tformer.loading import load_checkpoint, load_weights
    from tformer.models.gpt import GPT

    out = export_checkpoint(checkpoint, tmp_path / "model.gguf", "gguf", type="q4_0")
    run = import_gguf(out, tmp_path / "run")
    held = load_checkpoint(run).model.blocks[0].ff.experts
    model = GPT(load_checkpoint(checkpoint).model.cfg)
    load_weights(model, run)
    experts = model.blocks[0].ff.experts
    assert experts.gate.shape == (6, 24, 32)
    assert torch.equal(experts.gate[2], held.gate[2].weight)
    tokens = torch.tensor([ROWS[0]])
    model.train()
    model(tokens).square().mean().backward()
    assert experts.gate.grad is not None and experts.gate.grad.abs().sum() > 0


@pytest.mark.parametrize("change, message", [
    ({"expert_used_count": None}, "the metadata has no {arch}.expert_used_count"),
    ({"expert_count": 5}, "stacks 6 experts, the metadata says 5"),
])
def test_a_gguf_file_s_mixture_that_does_not_add_up_is_named(saved, checkpoint, tmp_path,
                                                              change, message):
    pytest.importorskip("gguf")
    from tformer.interop.command import export_checkpoint
    from tformer.interop.gguf import model_from_gguf, read_gguf

    file = read_gguf(export_checkpoint(checkpoint, tmp_path / "model.gguf", "gguf"))
    for key, value in change.items():
        if value is None:
            del file.metadata[f"{file.architecture}.{key}"]
        else:
            file.metadata[f"{file.architecture}.{key}"] = value
    with pytest.raises(TformerError, match=message.format(arch=file.architecture)):
        model_from_gguf(file)


def test_a_gguf_file_s_k_quant_expert_stacks_are_kept_as_blocks(tmp_path):
    """A q4_k_m export of a mixture whose experts' rows are whole super-blocks (256 values):
    its stacks in Q4_K, the last layer's down projections in Q6_K (llama.cpp's ffn_down
    rule, which counts the experts' too). Imported, each expert holds its slice of the
    file's K blocks byte for byte, the model computes with them, and goes out again."""
    pytest.importorskip("gguf")
    from safetensors import safe_open

    from tformer.interop.command import export_checkpoint, import_checkpoint
    from tformer.interop.gguf import convert_gguf, model_from_gguf, read_gguf
    from tformer.kernels.blocks import BlockLinear
    from tformer.loading import load_checkpoint, stored_formats

    from .test_llama import bpe_tokenizer

    config = transformers.Qwen3MoeConfig(
        **{**COMMON, "hidden_size": 256}, intermediate_size=256, num_experts=4,
        moe_intermediate_size=256, head_dim=64, norm_topk_prob=True,
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    randomise(hf)
    hf.save_pretrained(tmp_path / "source")
    bpe_tokenizer().save_pretrained(tmp_path / "source")
    checkpoint = import_checkpoint(tmp_path / "source", tmp_path / "ours")
    out = export_checkpoint(checkpoint, tmp_path / "model.gguf", "gguf", type="q4_k_m")
    file = read_gguf(out)
    types = {name: file.tensors[f"{name}.weight"].type
             for name in ("blk.0.ffn_gate_exps", "blk.0.ffn_down_exps", "blk.1.ffn_up_exps",
                          "blk.1.ffn_down_exps", "blk.1.ffn_gate_inp")}
    assert types == {"blk.0.ffn_gate_exps": "Q4_K", "blk.0.ffn_down_exps": "Q4_K",
                     "blk.1.ffn_up_exps": "Q4_K", "blk.1.ffn_down_exps": "Q6_K",
                     "blk.1.ffn_gate_inp": "F32"}
    kept, _ = convert_gguf(out, tmp_path / "run")
    assert kept["Q4_K"] and kept["Q6_K"]
    formats = stored_formats(tmp_path / "run")
    assert formats["blocks.0.ff.experts.gate.3.weight"] == "q4_k"
    assert formats["blocks.1.ff.experts.down.2.weight"] == "q6_k"
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        held = f.get_tensor("blocks.1.ff.experts.down.2.weight")
    stack = file.tensors["blk.1.ffn_down_exps.weight"]
    assert torch.equal(held, torch.from_numpy(np.array(stack.data[2])))

    model = load_checkpoint(tmp_path / "run").model
    experts = model.blocks[1].ff.experts
    assert type(experts.gate[0]) is BlockLinear and experts.down[2].fmt == "q6_k"
    tokens = torch.tensor([ROWS[0]])
    with torch.no_grad():  # against the file's weights dequantized to fp32
        expected, got = model_from_gguf(file)[0](tokens), model(tokens)
    assert (got - expected).norm() / expected.norm() < 0.05  # activations in 8-bit blocks
    again = read_gguf(export_checkpoint(tmp_path / "run", tmp_path / "again.gguf", "gguf",
                                        type="q4_k_m"))
    assert again.tensors["blk.1.ffn_down_exps.weight"].type == "Q6_K"
