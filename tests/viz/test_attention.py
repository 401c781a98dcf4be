"""Recorded attention probabilities: the explicit path equals the fused kernel, the
probabilities equal a naive computation, and the maps are drawn layer by head."""

import math

import pytest
import torch

from tformer.cli import main
from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.decoding.beam import beam_search
from tformer.registry import get_family
from tformer.viz.attention import (
    plot_attention,
    recording_attention,
    seq2seq_attention,
    transformer_xl_attention,
)

TEXT = "First Citizen: Before we proceed any further, hear me speak."


def model_of(family, **fields):
    cfg = config_from_dict({"model": {"family": family, **fields}})
    model = get_family(family).model(cfg.model)
    return model.eval()


def test_gpt_recording_leaves_the_output_unchanged_and_keeps_probabilities():
    model = model_of("gpt", vocab_size=30, context=16, n_layer=2, n_head=3, d_model=24,
                     d_value=5)
    tokens = torch.randint(0, 30, (2, 11))
    fused = model(tokens)
    with recording_attention(model) as recorded:
        explicit = model(tokens)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-6)
    assert list(recorded) == ["blocks.0.attn", "blocks.1.attn"]
    probs = recorded["blocks.0.attn"][0]
    assert probs.shape == (2, 3, 11, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 11))
    assert (probs.triu(1) == 0).all(), "causal: no weight on later tokens"
    assert model.blocks[0].attn.recorded is None, "recording ends with the block"

    # Independent: the first layer's probabilities from its weights, one head at a time.
    block = model.blocks[0]
    x = model.embed(tokens) + model.positions(torch.arange(11))
    h = block.attn_residual.norm(x) if model.cfg.norm == "pre" else x
    W, b = block.attn.qkv_proj.weight, block.attn.qkv_proj.bias
    d = 24 // 3
    for head in range(3):
        q = h @ W[head * d : (head + 1) * d].T + b[head * d : (head + 1) * d]
        k = h @ W[24 + head * d : 24 + (head + 1) * d].T + b[24 + head * d : 24 + (head + 1) * d]
        expected = torch.zeros(2, 11, 11)
        for i in range(11):
            scores = (q[:, i : i + 1] @ k[:, : i + 1].transpose(1, 2)) / math.sqrt(d)
            expected[:, i, : i + 1] = scores.softmax(-1)[:, 0]
        torch.testing.assert_close(probs[:, head], expected, rtol=1e-5, atol=1e-6)


def test_seq2seq_recording_matches_fused_in_training_and_in_beam_search():
    model = model_of("seq2seq", vocab_size=20, max_len=24, n_layer=2, n_head=2, d_model=16,
                     d_ff=32)
    src = torch.randint(3, 20, (3, 7))
    src_real = torch.ones_like(src, dtype=torch.bool)
    src_real[1, 5:] = False
    tgt = torch.randint(3, 20, (3, 6))
    fused = model(src, src_real, tgt)
    with recording_attention(model) as recorded:
        explicit = model(src, src_real, tgt)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-6)
    cross = recorded["decoder.0.cross_attn"][0]
    assert cross.shape == (3, 2, 6, 7)
    assert (cross[1, :, :, 5:] == 0).all(), "no weight on source padding"

    # Beam search reads shared encoder outputs (a view per sentence): same hypotheses.
    args = dict(beam=3, alpha=0.6, max_len_a=1.0, max_len_b=4, n_best=1,
                early_stopping=False, bos_id=1, eos_id=2, pad_id=0)
    plain = beam_search(model, src, src_real, **args)
    with recording_attention(model):
        recorded_search = beam_search(model, src, src_real, **args)
    assert [h[0].tokens for h in plain] == [h[0].tokens for h in recorded_search]
    assert [h[0].score for h in plain] == pytest.approx([h[0].score for h in recorded_search])


def test_transformer_xl_maps_mark_the_memory():
    tokenizer = CharTokenizer(TEXT)
    model = model_of("transformer-xl", vocab_size=tokenizer.vocab_size, context=8,
                     mem_len=12, n_layer=2, n_head=2, d_model=16)
    maps = transformer_xl_attention(model, tokenizer, TEXT[:30])
    (group,) = maps.groups
    assert group.memory == 12 and len(group.queries) == 8
    assert group.weights.shape == (2, 2, 8, 20) and len(group.keys) == 20
    assert "".join(group.keys).replace("\u2423", " ") == TEXT[10:30]
    torch.testing.assert_close(group.weights.sum(-1), torch.ones(2, 2, 8))
    fig = plot_attention(maps)
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"]
    assert len(visible) == 4
    # The memory boundary is drawn on every map.
    assert all(any(list(line.get_xdata()) == [11.5, 11.5] for line in ax.lines)
               for ax in visible)


def test_seq2seq_maps_align_the_translation_with_the_source(runs):
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(runs["seq2seq"])
    maps = seq2seq_attention(loaded.model, loaded.tokenizer, "347")
    encoder, cross = maps.groups
    assert encoder.keys == ["3", "4", "7", "</s>"] == cross.keys
    n_out = len(cross.queries)
    assert cross.queries[-1] == "</s>" and cross.weights.shape == (1, 2, n_out, 4)
    assert maps.note.startswith("translation: ")


def test_the_command_draws_layers_by_heads(runs, tmp_path, capsys):
    out = tmp_path / "att.png"
    assert main(["attention", str(runs["a"]), "--text", "All: Speak", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["attention", str(runs["seq2seq"]), "--source", "12", "-o", str(out)]) == 0
    assert main(["attention", str(runs["a"]), "--source", "x", "-o", str(out)]) == 2
    assert "give the sentence with --text" in capsys.readouterr().err
    assert main(["attention", str(runs["a"]), "--text", "", "-o", str(out)]) == 2
    assert "no tokens" in capsys.readouterr().err


def test_the_grid_has_token_labels(runs):
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(runs["a"])
    maps = get_family("gpt").attention(loaded.model, loaded.tokenizer, "All: Speak")
    fig = plot_attention(maps)
    maps_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(maps_axes) == 2 * 2  # layers x heads
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert "".join(labels).replace("\u2423", " ") == "All: Speak"
    assert fig.axes[0].get_title().endswith("layer 1, head 1")


def test_the_maps_are_readable(runs, tmp_path):
    """Whitespace shows as symbols, every map has a colour bar, and the token labels are
    at least 6 points on a map of 64 tokens."""
    from tformer.loading import load_checkpoint
    from tformer.viz.attention import shown_token

    assert shown_token(" a\tb\n\r") == "\u2423a\u2192b\u23ce\\r"
    loaded = load_checkpoint(runs["a"])
    maps = get_family("gpt").attention(loaded.model, loaded.tokenizer, "All: Speak\nAll")
    fig = plot_attention(maps, title="a/best")
    maps_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == len(maps_axes) == 4
    labels = [t.get_text() for t in maps_axes[0].get_xticklabels()]
    assert "\u2423" in labels and "\u23ce" in labels and "" not in labels
    assert min(t.get_fontsize() for t in maps_axes[0].get_xticklabels()) >= 6
    fig.savefig(tmp_path / "maps.png", dpi=80)
