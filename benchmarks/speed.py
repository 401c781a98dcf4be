"""tformer beside Hugging Face transformers on the same model shapes, measured in one run.

    make bench                                  # installs the `bench` extra, then runs this
    .venv/bin/python benchmarks/speed.py [--repeats 5] [--json] [--only gpt-train,...]

Each row times tformer and the peer in alternation, `repeats` times each, and reports the
medians and their ratio (tformer / peer; above 1 is faster). The machine's own limits come
first: the fp32 matmul peak and the memory read bandwidth (of a plain sum, and of the
matrix-vector products a batch-1 decoding step is made of, with tformer's kernel, oneDNN's
prepacked one and F.linear), from which the table derives
training MFU (model FLOPs per second over the matmul peak) and, for decoding at batch 1,
the fraction of the bandwidth limit (every token reads every weight once).

Rows: GPT training at 4x128 (context 64, batch 12) and 6x384 (context 256, batch 8), the
same fused AdamW, against GPT2LMHeadModel; greedy generation with a GPT-2 small (12 x 768,
vocabulary 50257, 16-token prompt, 128 new tokens) at batch 1 and 8 against
GPT2LMHeadModel.generate on the same weights (imported from it, and checked to give the
same greedy tokens before timing), and tformer's int8 weights against its fp32 ones; beam-4
translation (d_model 256, 3 + 3 layers, vocabulary 8000, 20-token inputs, 30 output
tokens) at batch 1 and 16 against MarianMTModel.generate; Transformer-XL training beside
the GPT of the same size. The llama rows (llama_rows.py) do for a model of SmolLM2-135M's
shape (30 x 576, grouped-query attention, SwiGLU, RMSNorm, rotary, vocabulary 49152, tied
embeddings) what the GPT-2 rows do, against LlamaForCausalLM: greedy generation at batch 1
and 8 and int8 at batch 1 (llama-generate), and training the same widths at 6 layers,
context 256, batch 8 (llama-train), MFU counted from the model's layers.

Every row names the instruction set tformer's kernels ran (kernels.int8.isa(): AVX-512
VNNI, AVX-VNNI, AVX2 or torch), and the header the switches that choose the libraries' own:

    TFORMER_ISA=avx2 CT2_FORCE_CPU_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        .venv/bin/python benchmarks/speed.py --only translate

runs every side as an AVX2-only CPU would, on a machine with AVX-512; with
TFORMER_ISA=avxvnni ONEDNN_MAX_CPU_ISA=AVX2_VNNI MKL_ENABLE_INSTRUCTIONS=AVX2_E1 instead,
as one with AVX-VNNI and no AVX-512 would (CTranslate2 has no switch of its own for it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from tformer.kernels.build import ISA_NAMES

from tformer.decoding.lm import generate
from tformer.evaluation.loss import Targets
from tformer.kernels.formats import quantize_model
from tformer.kernels.int8 import isa
from tformer.kernels.prepack import PackedLinear, prepack, prepack_available
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.transformer_xl import Memory, TransformerXL, TransformerXLConfig


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- the machine ---------------------------------------------------------------------------


def matmul_peak(repeats: int) -> float:
    """Best fp32 GFLOP/s of a 2048^3 matmul."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    return max(2 * 2048**3 / seconds(lambda: torch.mm(a, b)) for _ in range(repeats)) / 1e9


def read_bandwidth(repeats: int) -> float:
    """Median GB/s of summing a 512 MB tensor (reads every byte once)."""
    x = torch.ones(128 * 1024 * 1024)
    x.sum()
    return statistics.median(x.numel() * 4 / seconds(x.sum) for _ in range(repeats)) / 1e9


def matvec_bandwidth(repeats: int, kernel: str) -> float:
    """Median GB/s at which matrix-vector products stream 377 MB of fp32 weights: the rate
    a batch-1 decoding step can read its weights at, with F.linear's kernel ("linear"),
    oneDNN's prepacked one ("onednn"), or what tformer decodes with ("tformer": its own
    kernel where it is available, else oneDNN's)."""
    layers = [torch.nn.Linear(768, 3072, bias=False) for _ in range(40)]
    if kernel != "linear":
        layers = [PackedLinear(layer) for layer in layers]
        for layer in layers:
            layer.native &= kernel == "tformer"
    x = torch.randn(1, 768)
    nbytes = sum(layer.weight.numel() * 4 for layer in layers)

    @torch.no_grad()
    def run() -> None:
        for layer in layers:
            layer(x)

    run()
    return statistics.median(nbytes / seconds(run) for _ in range(repeats)) / 1e9


# --- models of the same shape on both sides -----------------------------------------------


def gpt_pair(n_layer: int, n_head: int, d_model: int, context: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    ours = GPT(
        GPTConfig(
            vocab_size=vocab,
            context=context,
            n_layer=n_layer,
            n_head=n_head,
            d_model=d_model,
            d_ff=4 * d_model,
        )
    )
    peer = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab,
            n_positions=context,
            n_embd=d_model,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    return ours, peer


def gpt2_small_imported():
    """A GPT-2 small (12 x 768, vocabulary 50257, context 1024) with random weights, and the
    tformer GPT imported from that very model, as `tformer import` converts it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tformer.interop.gpt2 import gpt_from_hf

    peer = GPT2LMHeadModel(
        GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                   eos_token_id=0)
    ).eval()
    ours = gpt_from_hf(peer.config.to_dict(), peer.state_dict(), "GPT2LMHeadModel")
    return ours, peer


def check_same_greedy_tokens(ours, peer, label: str, new: int = 24) -> None:
    """Before timing: both sides must produce the same greedy tokens at batch 1 and 8."""
    for batch in (1, 8):
        prompt = torch.randint(0, 1000, (batch, 16), generator=torch.Generator().manual_seed(1))
        mine = torch.stack(list(generate(ours, prompt, max_new_tokens=new, temperature=0.0)), 1)
        theirs = peer.generate(prompt, attention_mask=torch.ones_like(prompt),
                               max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0)[:, prompt.shape[1]:]
        if not torch.equal(mine, theirs):
            raise SystemExit(f"{label}: tformer and {type(peer).__name__} disagree at batch "
                             f"{batch}; not timing different work")


def training_flops_per_token(model: torch.nn.Module, n_layer: int, d_model: int, T: int) -> float:
    """6 N + 12 L T D (Chowdhery et al. 2022, app. B): N counts the weights used in matmuls
    (the tied output projection included, position tables not)."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "pos" not in name)
    return 6 * n + 12 * n_layer * T * d_model


def txl_training_flops_per_token(
    n_layer: int, d_model: int, d_ff: int, vocab: int, T: int, M: int, B: int
) -> float:
    """The same count for Transformer-XL, term by term (forward 2 flops per multiply-add,
    backward twice that): every token's own projections and FFN (6 x 12 D^2 with d_ff 4D),
    the keys and values of the M remembered states (forward, and the weight gradient only:
    the memory takes none), attention over K = M + T keys (6 K D for q.k and for p.v as in
    the GPT formula, and 6 K D more for the position term), the position projection of K
    distances per segment of B T tokens, and the tied output projection."""
    K = M + T
    own = 6 * (4 * d_model * d_model + 2 * d_model * d_ff)
    memory = 4 * (2 * d_model * d_model) * M / T
    attention = 12 * K * d_model + 6 * K * d_model
    positions = 6 * K * d_model * d_model / (B * T)
    return n_layer * (own + memory + attention + positions) + 6 * vocab * d_model


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The optimizer both sides train with: AdamW's fused kernel, as tformer's trainer runs it."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def gpt_train_step(model, batch: int, context: int, vocab: int, steps: int, ours: bool):
    opt = adamw(model)
    data = torch.randint(0, vocab, (steps, batch, context + 1))
    model.train()

    def run() -> None:
        for s in range(steps):
            if ours:
                loss = model(data[s, :, :-1], targets=Targets(data[s, :, 1:]))  # as trained
            else:
                logits = model(data[s, :, :-1]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), data[s, :, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def gpt_generate(model, batch: int, new: int, ours: bool):
    prompt = torch.randint(0, 1000, (batch, 16))
    model.eval()
    if ours:
        return lambda: list(generate(model, prompt, max_new_tokens=new, temperature=0.0))
    mask = torch.ones_like(prompt)
    return lambda: model.generate(
        prompt,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )


# --- rows of one model ---------------------------------------------------------------------


def training_row(label: str, ours, peer, batch: int, context: int, vocab: int, flops: float,
                 repeats: int, peak: float) -> dict:
    """Training tokens/s of both sides on the same data, and tformer's MFU at `flops` a
    token."""
    steps = 5
    a, b = compare(
        gpt_train_step(ours, batch, context, vocab, steps, True),
        gpt_train_step(peer, batch, context, vocab, steps, False),
        steps * batch * context,
        repeats,
    )
    return dict(row=label, unit="tokens/s", tformer=a, peer=b, peer_name=type(peer).__name__,
                ratio=a / b, mfu=a * flops / (peak * 1e9))


def generation_rows(label: str, fp32, peer, greedy: bool, int8: bool, repeats: int,
                    bandwidth: float, matvec: float) -> list[dict]:
    """Greedy generation (16-token prompt, 128 new tokens) of a model imported from `peer`:
    at batch 1 and 8 against peer.generate, and with int8 weights against fp32 at batch 1."""
    ours = prepack(fp32)  # as `tformer generate` runs it
    check_same_greedy_tokens(ours, peer, label)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    new = 128
    rows = []
    for B in (1, 8) if greedy else ():
        a, b = compare(gpt_generate(ours, B, new, True), gpt_generate(peer, B, new, False),
                       B * new, repeats)
        row = dict(row=f"{label} greedy b{B}", unit="tokens/s", tformer=a, peer=b,
                   peer_name=f"{type(peer).__name__}.generate", ratio=a / b)
        if B == 1:
            row["bandwidth_fraction"] = a * weight_bytes / (bandwidth * 1e9)
            row["matvec_fraction"] = a * weight_bytes / (matvec * 1e9)
        rows.append(row)
    if int8:
        a, b = compare(gpt_generate(quantize_model(fp32, "int8"), 1, new, True),
                       gpt_generate(ours, 1, new, True), new, repeats)
        rows.append(dict(row=f"{label} greedy b1 int8", unit="tokens/s", tformer=a, peer=b,
                         peer_name="tformer fp32", ratio=a / b))
    return rows


# --- the table -----------------------------------------------------------------------------


ISA_SWITCHES = ("TFORMER_ISA", "CT2_FORCE_CPU_ISA", "ONEDNN_MAX_CPU_ISA",
                "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
"""The environment variables that choose each library's instruction set: tformer's kernels,
CTranslate2's, oneDNN's, MKL's and torch's own."""


def compare(ours: Callable, peer: Callable, work: float, repeats: int) -> tuple[float, float]:
    """Median rates (work per second) of two callables timed in alternation."""
    ours(), peer()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(work / seconds(ours))
        b.append(work / seconds(peer))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--translate-len", type=int, default=30,
                        help="output tokens per sentence in the translation rows")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated row groups: machine, gpt-train, gpt-generate, int8, translate, "
             "txl, llama-generate, llama-train",
    )
    args = parser.parse_args()
    groups = set(args.only.split(",")) if args.only else None
    wanted = lambda name: groups is None or name in groups  # noqa: E731
    torch.manual_seed(0)
    rows: list[dict] = []

    def emit(**row) -> None:
        if row["row"] != "machine":
            row["isa"] = ISA_NAMES[isa()]
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    peak = matmul_peak(5)
    bandwidth = read_bandwidth(5)
    matvec_linear = matvec_bandwidth(5, "linear")
    packed = prepack_available()
    matvec_onednn = matvec_bandwidth(5, "onednn") if packed else matvec_linear
    matvec = matvec_bandwidth(5, "tformer") if packed else matvec_linear
    emit(
        row="machine",
        matmul_peak_gflops=round(peak, 1),
        read_bandwidth_gbs=round(bandwidth, 2),
        matvec_bandwidth_gbs=round(matvec, 2),
        matvec_onednn_bandwidth_gbs=round(matvec_onednn, 2),
        matvec_linear_bandwidth_gbs=round(matvec_linear, 2),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        switches={name: os.environ[name] for name in ISA_SWITCHES if name in os.environ},
    )

    if wanted("gpt-train"):
        for L, H, D, T, B in ((4, 4, 128, 64, 12), (6, 6, 384, 256, 8)):
            ours, peer = gpt_pair(L, H, D, T, vocab=65)
            emit(**training_row(f"gpt train {L}x{D} ctx{T} b{B}", ours, peer, B, T, 65,
                                training_flops_per_token(ours, L, D, T), args.repeats, peak))

    if wanted("gpt-generate") or wanted("int8"):
        for row in generation_rows("gpt-2 small", *gpt2_small_imported(),
                                   wanted("gpt-generate"), wanted("int8"), args.repeats,
                                   bandwidth, matvec):
            emit(**row)

    if wanted("llama-generate") or wanted("llama-train"):
        import llama_rows

    if wanted("llama-generate"):
        for row in generation_rows("smollm2-135m", *llama_rows.llama_pair(llama_rows.SMOLLM2_135M),
                                   True, True, args.repeats, bandwidth, matvec):
            emit(**row)

    if wanted("llama-train"):
        L, T, B = llama_rows.TRAIN_LAYERS, 256, 8
        ours, peer = llama_rows.llama_pair(llama_rows.SMOLLM2_135M, L, T)
        emit(**training_row(f"llama train {L}x{ours.cfg.d_model} ctx{T} b{B}", ours, peer, B, T,
                            ours.cfg.vocab_size, llama_rows.training_flops_per_token(ours, T),
                            args.repeats, peak))
        del ours, peer

    if wanted("translate"):
        from opus_mt import Sides

        sides = Sides(torch.get_num_threads())
        L = args.translate_len
        for B in (1, 16):
            sides.check_same_tokens(B, L)
            src = sides.sources(B)
            pairs = (
                ("fp32", partial(sides.tformer, src, L), partial(sides.ctranslate2, src, L),
                 "CTranslate2 float32"),
                ("int8", partial(sides.tformer, src, L, int8=True),
                 partial(sides.ctranslate2, src, L, int8=True), "CTranslate2 int8"),
                ("fp32", partial(sides.tformer, src, L), partial(sides.marian, src, L),
                 "MarianMTModel.generate"),
                ("int8", partial(sides.tformer, src, L, int8=True),
                 partial(sides.tformer, src, L), "tformer fp32"),
            )
            with torch.no_grad():
                for label, ours, peer, peer_name in pairs:
                    a, b = compare(ours, peer, B, args.repeats)
                    emit(row=f"opus-mt beam4 b{B} {label}", unit="sentences/s", tformer=a,
                         peer=b, peer_name=peer_name, ratio=a / b)
        del sides

    if wanted("txl"):
        L, D, F_, V, T, M, B = 4, 128, 512, 65, 64, 64, 12
        cfg = dict(vocab_size=V, n_layer=L, n_head=4, d_model=D, d_ff=F_)
        txl = TransformerXL(TransformerXLConfig(context=T, mem_len=M, **cfg))
        steps = 5
        memory = Memory(M)
        data = torch.randint(0, V, (steps, B, T + 1))
        opt = adamw(txl)

        def txl_steps() -> None:
            for s in range(steps):
                txl(data[s, :, :-1], memory=memory, targets=Targets(data[s, :, 1:])).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        txl_flops = txl_training_flops_per_token(L, D, F_, V, T, M, B)
        # Beside the GPT of the same segment length, and the GPT whose context spans what a
        # Transformer-XL query sees (M + T), at the same tokens per step.
        for context, batch in ((T, B), (T + M, B * T // (T + M))):
            gpt = GPT(GPTConfig(context=context, **cfg))
            a, b = compare(
                txl_steps,
                gpt_train_step(gpt, batch, context, V, steps, True),
                steps * B * T,
                args.repeats,
            )
            gpt_flops = training_flops_per_token(gpt, L, D, context)
            emit(
                row=f"txl train {L}x{D} seg{T} mem{M} b{B}",
                unit="tokens/s",
                tformer=a,
                peer=b,
                peer_name=f"tformer GPT ctx{context} b{batch}",
                ratio=a / b,
                mfu=a * txl_flops / (peak * 1e9),
                peer_mfu=b * gpt_flops / (peak * 1e9),
                flops_ratio=gpt_flops / txl_flops,
            )

    if not args.json:
        print_table(rows)


def print_table(rows: list[dict]) -> None:
    machine = rows[0]
    print(
        f"torch {machine['torch']}, {machine['threads']} threads: fp32 matmul peak "
        f"{machine['matmul_peak_gflops']:.0f} GFLOP/s, memory read "
        f"{machine['read_bandwidth_gbs']:.1f} GB/s (sum), "
        f"{machine['matvec_bandwidth_gbs']:.1f} GB/s (matrix-vector as tformer decodes; "
        f"{machine['matvec_onednn_bandwidth_gbs']:.1f} oneDNN prepacked, "
        f"{machine['matvec_linear_bandwidth_gbs']:.1f} F.linear)"
    )
    switches = " ".join(f"{k}={v}" for k, v in machine["switches"].items()) or "none"
    print(f"torch's kernels: {machine['torch_capability']}; instruction-set switches: {switches}")
    print(f"{'row':<34}{'unit':<13}{'tformer':>10}{'peer':>10}{'ratio':>8}  notes")
    for r in rows[1:]:
        notes = [f"tformer on {r['isa']}", f"vs {r['peer_name']}"]
        if "mfu" in r:
            notes.append(f"MFU {r['mfu']:.0%}")
        if "peer_mfu" in r:
            notes.append(
                f"GPT MFU {r['peer_mfu']:.0%}; equal MFU would give {r['flops_ratio']:.2f}x"
            )
        if "bandwidth_fraction" in r:
            notes.append(
                f"{r['bandwidth_fraction']:.0%} of read / {r['matvec_fraction']:.0%} of "
                f"matrix-vector bandwidth"
            )
        print(
            f"{r['row']:<34}{r['unit']:<13}{r['tformer']:>10,.1f}{r['peer']:>10,.1f}"
            f"{r['ratio']:>7.2f}x  {', '.join(notes)}"
        )


if __name__ == "__main__":
    main()
