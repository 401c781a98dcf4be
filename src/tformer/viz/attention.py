"""Attention maps: what each head of each layer attends to, for one text.

`recording_attention(model)` makes every attention layer keep its probabilities while a
forward pass runs (through the explicit path: the fused kernel never forms them). The
family's `attention` entry in the registry turns a text into `AttentionMaps`, and
`plot_attention` draws them as a grid, one row per layer and one column per head:

- language models: causal self-attention over the text;
- Transformer-XL: the current segment's queries over [memory; segment], the memory marked;
- translation: encoder self-attention over the source, and the decoder's cross-attention
  from the greedy translation it produced to the source (the alignment).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tformer.data.tokenizers import Tokenizer
from tformer.errors import TformerError
from tformer.layers.attention import MultiHeadAttention
from tformer.models.transformer_xl import Memory, RelativeAttention
from tformer.viz import require

RECORDING = (MultiHeadAttention, RelativeAttention)
MAX_TOKENS = 64
"""More labels than this on an axis are unreadable."""


@contextmanager
def recording_attention(model: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """{layer name: [probabilities of each forward pass, (B, H, T, S)]} for every attention
    layer of `model`, filled while the block runs."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, RECORDING)}
    for module in layers.values():
        module.recorded = []
    try:
        yield {name: module.recorded for name, module in layers.items()}
    finally:
        for module in layers.values():
            module.recorded = None


@dataclass
class MapGroup:
    """One grid of heatmaps: (n_layer, H, queries, keys) weights of one sequence."""

    title: str
    weights: Tensor
    queries: list[str]
    keys: list[str]
    memory: int = 0
    """Keys before this index are Transformer-XL memory positions."""


@dataclass
class AttentionMaps:
    groups: list[MapGroup] = field(default_factory=list)
    note: str = ""
    """Something the reader should know (a cut text, the translation produced)."""


VISIBLE = {" ": "\u2423", "\n": "\u23ce", "\t": "\u2192"}
"""Characters a tick label would show as nothing, as the symbols editors use for them (each
in matplotlib's own font, DejaVu Sans)."""


def shown_token(token: str) -> str:
    """A token as a tick label: spaces, line ends and tabs visible, other characters that do
    not print as their escapes (\\r, \\x00)."""
    return "".join(VISIBLE.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in token)


def token_labels(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token as text, with spaces, line ends and tabs made visible (shown_token)."""
    return [shown_token(tokenizer.decode([i])) if tokenizer.decode([i]) else f"<{i}>"
            for i in ids]


def stack_layers(recorded: dict[str, list[Tensor]], suffix: str, call: int = -1) -> Tensor:
    """(n_layer, H, T, S) of the first sequence, from the layers whose name ends with
    `suffix`, in model order, taking each one's `call`-th forward pass."""
    maps = [calls[call][0] for name, calls in recorded.items() if name.endswith(suffix)]
    return torch.stack(maps)


def encode_text(tokenizer: Tokenizer, text: str, limit: int) -> tuple[list[int], str]:
    ids = tokenizer.encode(text)
    if not ids:
        raise TformerError("the text has no tokens; give some text to look at")
    note = ""
    if len(ids) > limit:
        note = f"the text is {len(ids)} tokens; the first {limit} are shown"
        ids = ids[:limit]
    return ids, note


@torch.no_grad()
def gpt_attention(model: nn.Module, tokenizer: Tokenizer, text: str) -> AttentionMaps:
    ids, note = encode_text(tokenizer, text, min(MAX_TOKENS, model.cfg.context))
    with recording_attention(model) as recorded:
        model(torch.tensor([ids]))
    labels = token_labels(tokenizer, ids)
    return AttentionMaps([MapGroup("self-attention", stack_layers(recorded, ".attn"), labels,
                                   labels)], note)


@torch.no_grad()
def transformer_xl_attention(model: nn.Module, tokenizer: Tokenizer, text: str) -> AttentionMaps:
    """The text's last segment over the memory the earlier tokens left. A text that fits in
    one segment is split in two, so that the memory has something in it."""
    ids, note = encode_text(tokenizer, text, MAX_TOKENS)
    segment = min(model.cfg.context, max(1, len(ids) // 2), len(ids))
    earlier, current = ids[: len(ids) - segment], ids[len(ids) - segment :]
    memory = Memory(model.cfg.memory_for_eval)
    for start in range(0, len(earlier), model.cfg.context):
        model(torch.tensor([earlier[start : start + model.cfg.context]]), memory=memory)
    remembered = earlier[len(earlier) - memory.length :] if memory.length else []
    with recording_attention(model) as recorded:
        model(torch.tensor([current]), memory=memory)
    keys = token_labels(tokenizer, remembered) + token_labels(tokenizer, current)
    group = MapGroup("relative self-attention over [memory; segment]",
                     stack_layers(recorded, ".attn"), token_labels(tokenizer, current), keys,
                     memory=len(remembered))
    return AttentionMaps([group], note)


@torch.no_grad()
def seq2seq_attention(model: nn.Module, tokenizer: Tokenizer, text: str) -> AttentionMaps:
    """Greedy-translate the source, then read the source and the translation again with
    teacher forcing, recording every layer."""
    from tformer.decoding.beam import greedy_search

    src_ids, note = encode_text(tokenizer, text, min(MAX_TOKENS, model.cfg.max_len) - 1)
    src_ids = src_ids + [tokenizer.eos_id]
    src = torch.tensor([src_ids])
    src_real = torch.ones_like(src, dtype=torch.bool)
    (found,) = greedy_search(model, src, src_real, alpha=0.0, max_len_a=0.0,
                             max_len_b=min(MAX_TOKENS, model.cfg.max_len - 1),
                             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                             pad_id=tokenizer.pad_id)
    out_ids = list(found.tokens)
    tgt = torch.tensor([[tokenizer.bos_id] + out_ids])
    with recording_attention(model) as recorded:
        model(src, src_real, tgt)
    source = token_labels(tokenizer, src_ids[:-1]) + ["</s>"]
    # Row i reads BOS + the first i output tokens and produces output token i (or EOS).
    target = token_labels(tokenizer, out_ids) + ["</s>"]
    translation = tokenizer.decode(out_ids)
    note = "; ".join(n for n in (note, f"translation: {translation}") if n)
    return AttentionMaps([
        MapGroup("encoder self-attention", stack_layers(recorded, ".attn"), source, source),
        MapGroup("cross-attention: each output token (rows) over the source (columns)",
                 stack_layers(recorded, ".cross_attn"), target, source),
    ], note)


def tick_size(count: int) -> float:
    """Labels of 8 points for a few tokens, down to 6 for many; more than a map can carry
    readably are thinned (every n-th, see plot_attention)."""
    return 8.0 if count <= 24 else 7.0 if count <= 48 else 6.0


def plot_attention(maps: AttentionMaps, title: str = "") -> Any:
    """A matplotlib Figure: for each group, one row per layer and one column per head, each
    map with its own colour bar (each on its own scale: heads that spread their weight
    thinly would otherwise show as flat colour)."""
    require("matplotlib")
    from matplotlib.figure import Figure

    rows = sum(g.weights.shape[0] for g in maps.groups)
    cols = max(g.weights.shape[1] for g in maps.groups)
    longest = max(max(len(g.queries), len(g.keys)) for g in maps.groups)
    # About a sixth of an inch a token, so that 8-point labels do not overlap.
    cell = min(9.0, max(2.6, 0.17 * min(longest, 64)))
    fig = Figure(figsize=(cols * (cell + 0.7) + 0.6, rows * (cell + 0.6) + 0.8),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    row = 0
    for group in maps.groups:
        n_layer, n_head = group.weights.shape[:2]
        keys, queries = group.keys, group.queries
        size = tick_size(max(len(keys), len(queries)))
        every = max(1, -(-max(len(keys), len(queries)) // 64))
        for layer in range(n_layer):
            for head in range(cols):
                ax = axes[row][head]
                if head >= n_head:
                    ax.set_visible(False)
                    continue
                image = ax.imshow(group.weights[layer, head].float().numpy(), cmap="viridis",
                                  vmin=0.0, aspect="auto", interpolation="nearest")
                bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
                bar.ax.tick_params(labelsize=7)
                ax.set_title(f"{group.title.split(':')[0]}\nlayer {layer + 1}, head {head + 1}",
                             fontsize=9)
                ax.set_xticks(range(0, len(keys), every), keys[::every], fontsize=size,
                              rotation=90)
                ax.set_yticks(range(0, len(queries), every), queries[::every], fontsize=size)
                if head == 0:
                    ax.set_ylabel("query", fontsize=9)
                ax.set_xlabel("key", fontsize=9)
                if group.memory:
                    # The memory's columns, set apart by a line and a label.
                    ax.axvline(group.memory - 0.5, color="red", linewidth=1.2)
                    ax.axvspan(-0.5, group.memory - 0.5, color="white", alpha=0.15)
                    ax.text(group.memory / 2 - 0.5, len(group.queries) / 2, "memory",
                            color="white", ha="center", va="center", fontsize=9,
                            rotation=90)
            row += 1
    fig.suptitle("\n".join(t for t in (title, maps.note) if t), fontsize=10)
    return fig
