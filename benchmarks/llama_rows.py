"""The Llama-layout models behind speed.py's llama rows, and a check that both sides compute
the same thing on them.

    .venv/bin/python benchmarks/llama_rows.py [--tiny]

The rows time a model of SmolLM2-135M's shape (30 layers x 576, 9 query heads sharing 3
key/value heads, SwiGLU of width 1536, RMSNorm, rotary, vocabulary 49152, tied
embeddings) with random weights, built as a LlamaForCausalLM and imported into tformer from
that very model, as `tformer import` converts it; training times the same widths at 6
layers. This script checks what speed.py's greedy-token check does not: that the two sides
give the same logits, and the same training loss and gradients, on both models. --tiny
checks small models of the same layout instead, to check the script.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tformer.evaluation.loss import Targets
from tformer.interop.llama import llama_from_hf
from tformer.models.gpt import GPT
from tformer.viz.cost import attention_flops, linear_flops

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    initializer_range=576**-0.5,
)
"""SmolLM2-135M's config.json, the fields that set its shape and its initial weights."""
TINY = dict(SMOLLM2_135M, vocab_size=1024, hidden_size=48, intermediate_size=96,
            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            max_position_embeddings=256)
"""The same layout in small: grouped-query attention (3 query heads a key/value head)."""
TRAIN_LAYERS = 6


def llama_pair(shape: dict, n_layer: int | None = None, context: int | None = None):
    """A LlamaForCausalLM of `shape` with random weights (n_layer layers and context
    positions where given), and the tformer GPT imported from that very model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(shape, num_hidden_layers=n_layer or shape["num_hidden_layers"],
                 max_position_embeddings=context or shape["max_position_embeddings"])
    peer = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0)).eval()
    ours = llama_from_hf(peer.config.to_dict(), peer.state_dict(), "LlamaForCausalLM")
    return ours, peer


def training_flops_per_token(model: GPT, T: int) -> float:
    """Forward and backward FLOPs per token at context T, counted from the model's own
    layers (tformer.viz.cost): 2 * in * out for every linear layer, the tied output
    projection included, and 4 D per key in attention; the backward pass twice the forward.
    On a GPT-2 layout this is 6 N + 12 L T D, the formula of the gpt rows; here it counts
    the narrower k/v projections of grouped-query attention and SwiGLU's third matrix."""
    return 3 * (linear_flops(model) + attention_flops(model, T))


def check_same_computation(ours: GPT, peer, batch: int, T: int) -> str:
    """The same logits, and after one backward pass of the same loss the same gradients,
    on both sides; a description of the gaps, or SystemExit where they are not rounding."""
    tokens = torch.randint(0, ours.cfg.vocab_size, (batch, T + 1),
                           generator=torch.Generator().manual_seed(0))
    ours.train(), peer.train()
    mine, theirs = ours(tokens[:, :-1]), peer(tokens[:, :-1]).logits
    loss = ours(tokens[:, :-1], targets=Targets(tokens[:, 1:]))  # as tformer trains
    peer_loss = F.cross_entropy(theirs.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward(), peer_loss.backward()
    grads = (ours.blocks[0].ff.down.weight.grad, peer.model.layers[0].mlp.down_proj.weight.grad)
    logits_gap = (mine - theirs).abs().max().item()
    loss_gap = (loss - peer_loss).abs().item()
    grad_gap = ((grads[0] - grads[1]).abs().max() / grads[1].abs().max()).item()
    ours.zero_grad(set_to_none=True), peer.zero_grad(set_to_none=True)
    ours.eval(), peer.eval()
    gaps = (f"logits within {logits_gap:.1e}, loss within {loss_gap:.1e}, layer-0 "
            f"down-projection gradient within {grad_gap:.1e} of its largest entry")
    if max(logits_gap, loss_gap, grad_gap) > 1e-3:
        raise SystemExit(f"tformer and LlamaForCausalLM disagree: {gaps}")
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small models, to check the script")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = TINY if args.tiny else SMOLLM2_135M
    T = 32 if args.tiny else 256
    for n_layer, batch in ((shape["num_hidden_layers"], 1), (TRAIN_LAYERS, 8)):
        ours, peer = llama_pair(shape, n_layer, T)
        gaps = check_same_computation(ours, peer, batch, T)
        print(f"{n_layer} x {shape['hidden_size']}, batch {batch} of {T} tokens: "
              f"same computation ({gaps}); "
              f"{training_flops_per_token(ours, T) / 1e6:.1f} MFLOP a training token")


if __name__ == "__main__":
    main()
