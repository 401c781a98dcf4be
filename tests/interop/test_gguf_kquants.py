"""GGUF files of llama.cpp's K types in and out: a tiny random llama file of each K type
imported with its blocks kept byte for byte and decoded as gguf.quants decodes them; the
q4_k_m, q5_k_m, q6_k, q5_0 and q5_1 exports read back by gguf's reader, their tensor types
by llama.cpp's rule, their values gguf.quants' decoding of the bytes written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from tformer.cli import main  # noqa: E402
from tformer.interop.gguf import import_gguf, read_gguf, unpermute  # noqa: E402
from tformer.kernels import blocks, library  # noqa: E402
from tformer.loading import load_checkpoint  # noqa: E402

K_TYPES = ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
N_HEAD, N_KV = 4, 2  # the tiny llama file's (conftest.write_tiny_gguf)


def decoded(tensor) -> torch.Tensor:
    """A file tensor as gguf.quants decodes it: fp32 [rows, cols]."""
    values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.ggml_type))
    return torch.from_numpy(np.array(values, dtype=np.float32))


@pytest.fixture(scope="module", params=K_TYPES)
def k_run(request, tiny_gguf, tmp_path_factory):
    kind = request.param
    path = tiny_gguf("llama", types=(kind,) * 2)
    return kind, path, import_gguf(path, tmp_path_factory.mktemp(f"k-{kind}") / "run")


def test_an_import_keeps_each_k_tensor_s_bytes_and_decodes_them_as_gguf_does(k_run):
    kind, path, run = k_run
    file = read_gguf(path)
    model = load_checkpoint(run, family="gpt").model
    fmt = kind.lower()
    for i in range(2):
        layer = model.blocks[i]
        t = {p: file.tensors[f"blk.{i}.{p}.weight"] for p in ("attn_q", "attn_k", "attn_v",
                                                              "ffn_down")}
        down = layer.ff.down
        assert isinstance(down, blocks.BlockLinear) and down.fmt == fmt
        assert np.array_equal(down.blocks.numpy(), t["ffn_down"].data)
        torch.testing.assert_close(down.weight, decoded(t["ffn_down"]), rtol=0, atol=1e-5)
        # the query and key rows go back to rotate-half order as whole rows of blocks
        qkv = layer.attn.qkv_proj
        assert isinstance(qkv, blocks.BlockLinear) and qkv.fmt == fmt
        want = torch.cat([unpermute(decoded(t["attn_q"]), N_HEAD),
                          unpermute(decoded(t["attn_k"]), N_KV), decoded(t["attn_v"])])
        torch.testing.assert_close(qkv.weight, want, rtol=0, atol=1e-5)
    held = load_file(run / "model.safetensors")["blocks.0.ff.down.weight"]
    assert held.dtype == torch.uint8  # the checkpoint holds the blocks, not fp32


def test_the_imported_model_runs_its_k_blocks_as_the_decoded_weights_do(k_run):
    kind, _, run = k_run
    model = load_checkpoint(run, family="gpt").model
    dense = load_checkpoint(run, family="gpt", weights="fp32").model
    tokens = torch.randint(0, 322, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(tokens), dense(tokens)
    # the activations rounded to Q8_K cost a little; the weights are the same
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("kind", ["Q6_K", "IQ4_XS"])
def test_a_file_of_a_whole_k_type_exports_as_the_same_bytes(kind, tiny_gguf, tmp_path):
    # q6_k and iq4_xs are the 256-value types export writes whole (q4_k and q5_k come in
    # mixtures)
    path = tiny_gguf("llama", types=(kind,) * 2)
    run = import_gguf(path, tmp_path / "run")
    out = tmp_path / "again.gguf"
    assert main(["export", str(run), "--out", str(out), "--type", kind.lower()]) == 0
    before, after = read_gguf(path), read_gguf(out)
    for name in ("blk.0.ffn_down.weight", "blk.1.attn_v.weight", "blk.1.attn_q.weight"):
        assert after.tensors[name].type == kind
        assert np.array_equal(after.tensors[name].data, before.tensors[name].data), name


def test_an_iq4_xs_export_is_the_quantizer_s_bytes_and_iq4_nl_comes_in_decoded(
        fp32_run, tiny_gguf, tmp_path):
    out = tmp_path / "iq4_xs.gguf"
    assert main(["export", str(fp32_run), "--out", str(out), "--type", "iq4_xs"]) == 0
    file = read_gguf(out)
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 30
    state = load_file(fp32_run / "model.safetensors")
    tensor = file.tensors["blk.0.ffn_up.weight"]
    assert tensor.type == "IQ4_XS"
    weight = state["blocks.0.ff.up.weight"]
    assert np.array_equal(tensor.data, blocks.quantize(weight, "iq4_xs").numpy())
    got = decoded(tensor)
    assert ((got - weight).norm() / weight.norm()).item() < 0.12
    # IQ4_NL (the 32-value form llama.cpp gives rows that are not whole super-blocks) is held
    # as q8_0 blocks of its values exactly, as gguf.quants decodes them
    path = tiny_gguf("llama", types=("IQ4_NL",) * 2)
    model = load_checkpoint(import_gguf(path, tmp_path / "nl"), family="gpt").model
    file = read_gguf(path)
    down = model.blocks[0].ff.down
    assert isinstance(down, blocks.BlockLinear) and down.fmt == "q8_0"
    torch.testing.assert_close(down.weight, decoded(file.tensors["blk.0.ffn_down.weight"]),
                               rtol=0, atol=0)
    want = torch.cat([unpermute(decoded(file.tensors["blk.1.attn_q.weight"]), N_HEAD),
                      unpermute(decoded(file.tensors["blk.1.attn_k.weight"]), N_KV),
                      decoded(file.tensors["blk.1.attn_v.weight"])])
    torch.testing.assert_close(model.blocks[1].attn.qkv_proj.weight, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def fp32_run(tiny_gguf, tmp_path_factory):
    """A llama checkpoint of fp32 weights (its tiny file's matrices all F32)."""
    path = tiny_gguf("llama", types=("F32",) * 2)
    return import_gguf(path, tmp_path_factory.mktemp("f32") / "run")


@pytest.mark.parametrize("mix,base", [("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K")])
def test_a_mixture_export_types_each_tensor_by_llama_cpp_s_rule(mix, base, fp32_run, tmp_path):
    out = tmp_path / f"{mix}.gguf"
    assert main(["export", str(fp32_run), "--out", str(out), "--type", mix]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == {"q4_k_m": 15, "q5_k_m": 17}[mix]
    file = read_gguf(out)
    types = {name: t.type for name, t in file.tensors.items() if len(t.shape) == 2}
    # two layers: llama.cpp's use_more_bits picks layer 1 (i >= 7 * 2 // 8) alone
    finer = {"output.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}
    assert {n for n, t in types.items() if t == "Q6_K"} == finer
    assert {t for n, t in types.items() if n not in finer} == {base}
    state = load_file(fp32_run / "model.safetensors")
    for name, ours in (("blk.0.ffn_down.weight", "blocks.0.ff.down.weight"),
                       ("blk.1.ffn_down.weight", "blocks.1.ff.down.weight"),
                       ("output.weight", "lm_head.weight")):
        tensor = file.tensors[name]
        fmt = tensor.type.lower()
        # the bytes are tformer's quantizer's, and decode as gguf.quants decodes them
        assert np.array_equal(tensor.data, blocks.quantize(state[ours], fmt).numpy())
        got = decoded(tensor)
        torch.testing.assert_close(got, blocks.dequantize(blocks.quantize(state[ours], fmt), fmt),
                                   rtol=0, atol=1e-6)
        bound = {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[tensor.type]
        assert ((got - state[ours]).norm() / state[ours].norm()).item() < bound, name
    # and it comes back in: the mixture's blocks kept byte for byte
    back = import_gguf(out, tmp_path / "back")
    held = load_file(back / "model.safetensors")
    assert np.array_equal(held["blocks.1.ff.down.weight"].numpy(),
                          file.tensors["blk.1.ffn_down.weight"].data)


@pytest.mark.parametrize("kind", ["q5_0", "q5_1"])
def test_5_bit_exports_are_gguf_s_own_quantizer_s_bytes(kind, fp32_run, tmp_path):
    out = tmp_path / f"{kind}.gguf"
    assert main(["export", str(fp32_run), "--out", str(out), "--type", kind]) == 0
    file = read_gguf(out)
    state = load_file(fp32_run / "model.safetensors")
    want = gguf.quants.quantize(state["blocks.0.ff.up.weight"].numpy(),
                                gguf.GGMLQuantizationType[kind.upper()])
    assert file.tensors["blk.0.ffn_up.weight"].type == kind.upper()
    assert np.array_equal(file.tensors["blk.0.ffn_up.weight"].data, want)


def test_rows_not_whole_super_blocks_export_in_llama_cpp_s_fallback(tmp_path):
    from tformer.interop.gguf_export import _stored

    # 576 inputs (SmolLM2's width): Q4_K -> Q5_0, Q6_K -> Q8_0, as llama.cpp writes them
    w = torch.randn(8, 576)
    for fmt, fallback in (("q4_k", "Q5_0"), ("q6_k", "Q8_0"), ("q5_k", "Q5_1")):
        array, raw = _stored("blk.0.ffn_up.weight", w, fmt)
        assert raw == gguf.GGMLQuantizationType[fallback]
        assert np.array_equal(array, gguf.quants.quantize(w.numpy(), raw))


def test_a_layer_of_mixed_types_is_held_in_the_finer_or_as_a_stack(
        tiny_gguf, tmp_path):
    # Q4_K_M's own mixtures: layer 0 as SmolLM2's file has it (its rows fall back to Q5_0,
    # attn_v to Q8_0), layer 1 as a model of 256-wide rows (Q4_K, attn_v Q6_K)
    types = ("F32", "Q5_0", "Q5_0", "Q8_0", "Q5_0", "Q5_0", "Q5_0", "Q6_K",
             "Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K", "Q6_K")
    path = tiny_gguf("llama", types=types)
    run = import_gguf(path, tmp_path / "run")
    file = read_gguf(path)
    model = load_checkpoint(run, family="gpt").model

    def want(i):
        t = {p: decoded(file.tensors[f"blk.{i}.{p}.weight"]) for p in ("attn_q", "attn_k",
                                                                       "attn_v")}
        return torch.cat([unpermute(t["attn_q"], N_HEAD), unpermute(t["attn_k"], N_KV),
                          t["attn_v"]])

    qkv = model.blocks[0].attn.qkv_proj
    assert isinstance(qkv, blocks.BlockLinear) and qkv.fmt == "q8_0"
    assert torch.equal(qkv.weight, want(0))  # the Q5_0 rows re-encoded, their values exact
    # Q4_K has no exact Q6_K form: that layer holds both, side by side, byte for byte
    qkv = model.blocks[1].attn.qkv_proj
    assert isinstance(qkv, blocks.StackedLinear) and qkv.fmt == "q4_k:384+q6_k:128"
    raw = {p: file.tensors[f"blk.1.{p}.weight"].data for p in ("attn_q", "attn_k", "attn_v")}
    assert np.array_equal(qkv.parts[1].blocks.numpy(), raw["attn_v"])
    assert torch.equal(qkv.weight, want(1))
    assert model.blocks[1].ff.down.fmt == "q6_k"
    # its product: each part's, side by side, through kinds.c's table or torch
    x = torch.randn(5, 256)
    with torch.no_grad():
        got = qkv(x)
        parts = torch.cat([p(x) for p in qkv.parts], dim=-1)
    assert torch.equal(got, parts)
    dense = load_checkpoint(run, family="gpt", weights="fp32").model  # the stack dequantized
    assert type(dense.blocks[1].attn.qkv_proj) is torch.nn.Linear
    assert torch.equal(dense.blocks[1].attn.qkv_proj.weight, want(1))
    tokens = torch.randint(0, 322, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(tokens), dense(tokens)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    # a decoding step runs the stack in C (step.c, through its kind's row) as the full
    # sequence does
    from tformer.decoding.lm import generate
    from tformer.kernels.step import _linear

    assert _linear(qkv).struct.kind == library.KIND_STACK
    run = lambda cache: torch.stack(list(generate(  # noqa: E731
        model, tokens[:, :4], max_new_tokens=8, temperature=0.0, use_cache=cache)))
    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q4_0"])
def test_a_tied_embedding_table_stays_blocks_for_the_lookup_and_the_output_layer(
        kind, tiny_gguf, tmp_path):
    """A tied token_embd (Q6_K as llama.cpp's Q4_K_M writes it, or a 32-value type) comes in
    as its blocks, once: the lookup decodes the rows it selects, each the whole table's row
    bit for bit; the output layer is a block product over the same bytes, the activations
    rounded to 8 bits (Q8_K or Q8_0); and the bytes go out again as they came."""
    from tformer.decoding.lm import generate
    from tformer.loading import WEIGHTS, stored_formats

    path = tiny_gguf("llama", types=(kind,) * 2, tied=True)
    run = import_gguf(path, tmp_path / "run")
    file, fmt = read_gguf(path), kind.lower()
    table = file.tensors["token_embd.weight"]
    state = load_file(run / WEIGHTS)
    assert "lm_head.weight" not in state  # the bytes once, for both
    assert np.array_equal(state["embed.weight"].numpy(), table.data)
    formats = stored_formats(run)
    assert formats["embed.weight"] == formats["lm_head.weight"] == fmt

    model = load_checkpoint(run, family="gpt").model
    assert isinstance(model.embed, blocks.BlockEmbedding)
    assert isinstance(model.lm_head, blocks.BlockLinear)
    assert model.lm_head.blocks is model.embed.blocks
    whole = blocks.dequantize(model.embed.blocks, fmt)
    torch.testing.assert_close(whole, decoded(table), rtol=0, atol=0)
    tokens = torch.randint(0, 322, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.embed(tokens), whole[tokens])

        # the output layer: the block arithmetic in float64, x rounded as the kernels do
        states = model.final_norm(model.stack(model.inputs(tokens)))
        got = model.lm_head(states).reshape(-1, whole.shape[0]).double()
    x = states.reshape(-1, whole.shape[1])
    values = blocks.ACTIVATION_VALUES[blocks.LAYOUTS[fmt].activation]
    q, d = blocks.quantize_activations(x, values)
    rounded = (q.double() * d.double()).reshape(x.shape)
    want = rounded @ whole.double().t()
    bound = 1e-5 * (rounded.abs() @ whole.double().abs().t() + 1)
    assert ((got - want).abs() <= bound).all()

    dense = load_checkpoint(run, family="gpt", weights="fp32").model
    assert type(dense.embed) is torch.nn.Embedding and dense.lm_head.weight is dense.embed.weight
    assert torch.equal(dense.embed.weight, whole)
    with torch.no_grad():
        a, b = model(tokens), dense(tokens)
        assert (a - b).abs().max() < 0.05 * b.abs().max()  # every layer's 8-bit activations
        # decoding steps (step.c's, over the cache) look the table up as the full pass does
        run_cache = lambda cache: torch.stack(list(generate(  # noqa: E731
            model, tokens[:, :4], max_new_tokens=6, temperature=0.0, use_cache=cache)))
        assert torch.equal(run_cache(True), run_cache(False))

    out = tmp_path / "again.gguf"
    assert main(["export", str(run), "--out", str(out), "--type", fmt]) == 0
    again = read_gguf(out)
    assert "output.weight" not in again.tensors
    for name, tensor in file.tensors.items():
        assert again.tensors[name].type == tensor.type, name
        assert np.array_equal(again.tensors[name].data, tensor.data), name
