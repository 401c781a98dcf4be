"""Weight formats: how a model's linear layers hold their weights for inference, one entry
each in FORMATS (`--weights NAME` on the command line, `weights=` in tformer.load).

An entry gives the format's name, its C tag (tformer.h's enum tformer_kind, one row of
kinds.c's table), how to make an nn.Linear into a layer of the format, and the self-check
of its kernels. A format's layer describes itself to step.c through `tformer_linear()`
(quantize.Int8Linear's is the example), so that a decoding step runs it in C without
asking which format it holds.

A new format is, file by file:
- here, one WeightFormat in FORMATS: its name, its kind, a line of help, the class that
  makes an nn.Linear into its layer, and that layer's check;
- tformer.h: its kind in enum tformer_kind (the block formats have theirs) and the
  prototype of its product, a tformer_linear_fn; kinds.c: its row, {name, product,
  geometry (values and bytes a block, the activations' blocks), quantizer}; a block
  format's geometry is blocks.LAYOUTS's row too, so that no other module assumes a block
  size;
- a C file of its kernels (the product reads struct tformer_linear's data, scales and
  bias), named in library.SOURCES, its exported functions in library.SIGNATURES;
- a Python module of its layer: forward through the kernel (torch where there is none),
  `tformer_linear()` returning a library.BoundLinear of its kind, and `check(lib)`, its
  self-check, run once through library.checked;
- tests: tests/kernels/test_formats.py runs every registered format through kinds.c's
  table against its layer's forward with no edit; its own test file compares its products
  with a float64 reference written out in the test.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from tformer.errors import TformerError
from tformer.kernels import blocks, fp32, int8, library
from tformer.kernels.prepack import PackedLinear, prepack, prepack_available, swap_linears
from tformer.kernels.quantize import Int8Linear


@dataclass(frozen=True)
class WeightFormat:
    """A weight format: its name on the command line, its C kind, a line for --help, how to
    make an nn.Linear into a layer of the format (None: fp32, the layer stays as it is, its
    weight prepacked for decoding's small products), and the self-check of its kernels
    (True: the native path computes right here; False: the format runs on torch)."""

    name: str
    kind: int
    summary: str
    quantize: Callable[[nn.Linear], nn.Module] | None
    check: Callable[[], bool]
    ggml_type: int | None = None
    """The GGUF tensor type whose raw blocks this format holds as they are (None: none)."""
    output: str | None = None
    """The format a model's output layer takes instead (OUTPUT_LAYERS), or None for this
    one: the 4-bit formats keep it in q8_0, as llama.cpp's quantizer keeps it finer. On
    SmolLM2-135M a q4_1 output layer cost 4.4% of WikiText-2 perplexity on its own
    (benchmarks/README.md, "Block formats")."""


FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", library.KIND_FP32, "fp32 weights", None, fp32.available),
    "int8": WeightFormat("int8", library.KIND_INT8,
                         "int8 weights, one scale a row, int8 products (CPU)", Int8Linear,
                         int8.available),
    **{name: WeightFormat(name, blocks.KINDS[name], summary, blocks.quantizer(name),
                          blocks.available, blocks.GGML_TYPES[name], output)
       for name, summary, output in (
           ("q8_0", "llama.cpp's Q8_0 blocks: 8 bits and a scale per 32 weights (CPU)", None),
           ("q4_0", "llama.cpp's Q4_0 blocks: 4 bits and a scale per 32 weights, the output "
                    "layer q8_0 (CPU)", "q8_0"),
           ("q4_1", "llama.cpp's Q4_1 blocks: 4 bits, a scale and a minimum per 32 weights, "
                    "the output layer q8_0 (CPU)", "q8_0"),
           ("q5_0", "llama.cpp's Q5_0 blocks: 5 bits and a scale per 32 weights, the output "
                    "layer q8_0 (CPU)", "q8_0"),
           ("q5_1", "llama.cpp's Q5_1 blocks: 5 bits, a scale and a minimum per 32 weights, "
                    "the output layer q8_0 (CPU)", "q8_0"),
           ("q4_k", "llama.cpp's Q4_K super-blocks: 4 bits per weight, 6-bit scales and "
                    "minimums per 32, the output layer q6_k (CPU)", "q6_k"),
           ("q5_k", "llama.cpp's Q5_K super-blocks: 5 bits per weight, 6-bit scales and "
                    "minimums per 32, the output layer q6_k (CPU)", "q6_k"),
           ("q6_k", "llama.cpp's Q6_K super-blocks: 6 bits per weight, 8-bit scales per 16 "
                    "(CPU)", None),
           ("iq4_xs", "llama.cpp's IQ4_XS super-blocks: 4.25 bits per weight, 16 non-linear "
                      "levels, 6-bit scales per 32, the output layer q6_k (CPU)", "q6_k"))},
}
"""Every weight format, by name. A K format's layer whose inputs are not whole super-blocks
of 256 takes blocks.FALLBACK's 32-value format, as llama.cpp's quantizer does. MIXES (below)
names the mixtures of them `--weights` also takes."""


@dataclass(frozen=True)
class Mix:
    """A mixture of formats by a layer's place, as llama.cpp's quantizer makes its _M files
    (llama-quant.cpp, llama_tensor_get_type, for LLAMA_FTYPE_MOSTLY_Q4_K_M and _Q5_K_M):
    the output layer and, in the layers `more_bits` picks, the value projection and the
    feed-forward's down projection take `finer`; every other layer `base`. tformer holds
    the query, key and value projections as one layer (attn.qkv_proj), so where llama.cpp
    gives attn_v alone Q6_K, the whole qkv_proj takes it."""

    name: str
    summary: str
    base: str
    finer: str

    def format_of(self, name: str, n_layer: int) -> str:
        """The format of the linear layer called `name` (its model's module path) in a
        model of n_layer layers."""
        if name in OUTPUT_LAYERS:
            return self.finer
        index = _layer_index(name)
        if index is not None and any(role in name for role in FINER_ROLES) \
                and more_bits(index, n_layer):
            return self.finer
        return self.base


FINER_ROLES = ("attn.qkv_proj", "attn.v_proj", "ff.down", "ff.experts.down.", "attn_v.",
               "ffn_down.", "ffn_down_exps.")
"""The layers a Mix gives more bits in the layers more_bits picks, llama.cpp's attn_v and
ffn_down (a mixture's experts' down projections among them, as llama.cpp counts them): by
tformer's module names, and by a GGUF file's tensor names (export)."""


def more_bits(i: int, n_layer: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
    between them."""
    return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2


def _layer_index(name: str) -> int | None:
    match = re.search(r"(?:^|\.)(\d+)\.", name)
    return None if match is None else int(match.group(1))


MIXES: dict[str, Mix] = {
    "q4_k_m": Mix("q4_k_m", "llama.cpp's Q4_K_M: q4_k, with q6_k for the output layer and "
                  "half the value and down projections (CPU)", "q4_k", "q6_k"),
    "q5_k_m": Mix("q5_k_m", "llama.cpp's Q5_K_M: q5_k, with q6_k for the output layer and "
                  "half the value and down projections (CPU)", "q5_k", "q6_k"),
}
"""The mixtures `--weights` also takes, by name."""


def register(fmt: WeightFormat) -> None:
    """Add a weight format to FORMATS; a name or kind already there is an error."""
    if fmt.name in FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is already registered")
    if any(other.kind == fmt.kind for other in FORMATS.values()):
        raise ValueError(f"weight format {fmt.name!r}: kind {fmt.kind} is already taken")
    FORMATS[fmt.name] = fmt


def weight_format(name: str) -> WeightFormat:
    """The format called `name`; a TformerError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise TformerError(f"unknown weight format {name!r}: use one of "
                           f"{', '.join([*FORMATS, *MIXES])}") from None


OUTPUT_LAYERS = ("lm_head", "out_proj")
"""The attributes a model holds its output layer (onto the vocabulary) under, at its top
level: GPT's and Transformer-XL's lm_head, the translation model's out_proj."""


def quantize_model(model: nn.Module, weights: str | None) -> nn.Module:
    """The model as decoding, evaluation and serving run it, its linear layers in the
    format `weights`: fp32 keeps them (prepacked for the small matmuls of decoding, on the
    CPU); another format makes a copy with each linear layer converted, except those the
    model names in `int8_skip` (its output projection, say), which stay fp32 (prepacked
    where oneDNN is available). The original model is left as it is. None: the weights as
    the model holds them (fp32's treatment for its nn.Linears, blocks kept as they are)."""
    if weights in MIXES:
        return _mixed(model, MIXES[weights])
    fmt = weight_format(weights or "fp32")
    if fmt.quantize is None:
        return prepack(model)
    if next(model.parameters()).device.type != "cpu":
        raise TformerError(f"--weights {fmt.name} runs on the CPU; pass --device cpu")
    skip = set(getattr(model, "int8_skip", ()))
    keep = PackedLinear if prepack_available() else (lambda linear: linear)
    # Stacked experts split into one linear layer a projection and an expert: each expert's
    # weight gets blocks (or int8 rows) of its own, and decoding still reads only the chosen.
    copy = swap_linears(
        model, lambda name, linear: keep(linear) if name in skip else fmt.quantize(linear),
        split=True)
    if fmt.output is not None:
        for attr in OUTPUT_LAYERS:
            layer = getattr(model, attr, None)
            if type(layer) is nn.Linear and attr not in skip:
                setattr(copy, attr, weight_format(fmt.output).quantize(layer))
    return _tied_table(model, copy)


def _tied_table(model: nn.Module, copy: nn.Module) -> nn.Module:
    """Where `model` ties its embedding table to its output layer (the pair its class names
    in `tied_table`: a GPT's embed and lm_head) and the copy's output layer now holds
    blocks, the copy's table looks its rows up in those same blocks (blocks.BlockEmbedding):
    one copy of the table, rounded as the output layer is, as llama.cpp's quantizer writes a
    tied token_embd in the output's type; the fp32 table is not held on. `copy` itself."""
    pair = getattr(model, "tied_table", None)
    if pair is None:
        return copy
    table, output = (getattr(model, attr, None) for attr in pair)
    held = getattr(copy, pair[1], None)
    if (isinstance(table, nn.Embedding) and isinstance(output, nn.Linear)
            and output.weight is table.weight and isinstance(held, blocks.BlockLinear)
            and held.in_features == table.embedding_dim):
        setattr(copy, pair[0], blocks.BlockEmbedding(held.blocks, held.fmt, held.in_features))
    return copy


def _mixed(model: nn.Module, mix: Mix) -> nn.Module:
    """quantize_model for a Mix: each linear layer in the format mix.format_of gives it
    (its place known by its weight, which the copy shares), those in `int8_skip` kept."""
    if next(model.parameters()).device.type != "cpu":
        raise TformerError(f"--weights {mix.name} runs on the CPU; pass --device cpu")
    skip = set(getattr(model, "int8_skip", ()))
    paths = {id(m.weight): name for name, m in model.named_modules()
             if type(m) is nn.Linear and name not in skip}
    indices = [_layer_index(name) for name in paths.values()]
    n_layer = max((i for i in indices if i is not None), default=-1) + 1
    keep = PackedLinear if prepack_available() else (lambda linear: linear)

    def swap(_: str, linear: nn.Linear) -> nn.Module:
        path = paths.get(id(linear.weight))
        if path is None:
            return keep(linear)
        return weight_format(mix.format_of(path, n_layer)).quantize(linear)

    return _tied_table(model, swap_linears(model, swap))
