"""The mixture's one-call step (kernels/experts.py, experts.c) against its module path and
against a float64 reference over the experts' rounded weights; its router against the
module's; and the layer step (step.c) that runs router and experts for a decoding step."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tformer.kernels import experts as expert_kernel
from tformer.kernels.formats import quantize_model
from tformer.layers import GatedFeedForward
from tformer.layers.experts import Experts, MixtureOfExperts, Router, make_glu

pytestmark = pytest.mark.skipif(not expert_kernel.available(), reason="no C kernels here")

D, F, E, K = 256, 64, 6, 2  # D a whole K super-block


def mixture(*, d_shared=0, glu="gated", bias=False, softmax="before",
            renormalise=True, seed=0) -> MixtureOfExperts:
    torch.manual_seed(seed)
    router = Router(D, E, K, softmax=softmax, renormalise=renormalise, bias=bias)
    experts = Experts(D, F, E, glu=make_glu(glu, "silu", 7.0, 1.702), bias=bias)
    shared = GatedFeedForward(D, d_shared, activation="silu", bias=False) if d_shared else None
    moe = MixtureOfExperts(router, experts, shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return moe.eval()


def both_paths(moe: MixtureOfExperts, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        experts, weights = moe.router(x)
        one = moe.one_call(x, experts, weights)
        assert one is not None
        return one, moe.through_modules(x, experts, weights)


OPTIONS = {"plain": {}, "shared": {"d_shared": 128},
           "clamped-bias": {"glu": "clamped", "bias": True, "softmax": "after"}}


@pytest.mark.parametrize("fmt", ["fp32", "int8", "q8_0", "q4_0", "q4_k"])
@pytest.mark.parametrize("kind", list(OPTIONS))
def test_the_step_computes_what_the_modules_do(fmt, kind):
    """The same chosen experts, the same products: within float rounding of the modules,
    for one to four rows (and seven, where rows share experts in other orders)."""
    moe = mixture(**OPTIONS[kind])
    if fmt != "fp32":
        moe = quantize_model(moe, fmt)
    torch.manual_seed(1)
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, D)
        one, modules = both_paths(moe, x)
        assert (one - modules).abs().max() <= 1e-5 * modules.abs().max(), (fmt, kind, rows)


@pytest.mark.parametrize("fmt", ["fp32", "q8_0", "q4_0", "q4_k"])
def test_the_step_is_the_float64_reference_of_the_rounded_experts(fmt):
    """Against every chosen expert in float64 over the weights as the format holds them:
    fp32 to float rounding, the block formats within the rounding of the activations to
    8 bits (a few parts in a thousand of each product)."""
    moe = mixture(renormalise=False)
    if fmt != "fp32":
        moe = quantize_model(moe, fmt)
    layers = moe.experts
    if fmt == "fp32":
        gate, up, down = layers.gate, layers.up, layers.down
    else:
        gate, up, down = ([m.weight for m in getattr(layers, p)] for p in ("gate", "up", "down"))
    torch.manual_seed(2)
    x = torch.randn(3, D)
    with torch.no_grad():
        experts, weights = moe.router(x)
        got = moe.one_call(x, experts, weights).double()
    want = expert_kernel.reference(x, experts, weights, gate, up, down)
    bound = 1e-6 if fmt == "fp32" else 2e-2
    assert (got - want).norm() / want.norm() < bound


def test_rows_beyond_the_step_s_limit_and_training_take_the_modules(monkeypatch):
    moe = mixture()
    ran = []
    monkeypatch.setattr(expert_kernel, "run", lambda *a: ran.append(a) or None)
    with torch.no_grad():
        moe(torch.randn(1, expert_kernel.MAX_ROWS + 1, D))
        moe.train()
        moe(torch.randn(1, 1, D))
    moe.eval()
    moe(torch.randn(1, 1, D))  # gradients wanted
    assert ran == []


def test_a_replaced_expert_is_read_anew():
    """The step's binding is made once; an expert's layer set afterwards is seen."""
    moe = quantize_model(mixture(), "q8_0")
    x = torch.randn(1, D)
    before, _ = both_paths(moe, x)
    chosen = moe.router(x)[0][0, 0].item()
    moe.experts.down[chosen] = quantize_model(torch.nn.Linear(F, D, bias=False), "q4_0")
    after, modules = both_paths(moe, x)
    assert not torch.equal(after, before)
    assert (after - modules).abs().max() <= 1e-5 * modules.abs().max()


def test_an_unknown_expert_id_is_refused():
    moe = mixture()
    binding = moe._binding()
    with pytest.raises(ValueError, match="out of range"):
        expert_kernel.run(binding, torch.randn(1, D), torch.tensor([[0, E]]), torch.ones(1, 2))


@pytest.mark.parametrize("softmax, renormalise", [("before", True), ("before", False),
                                                  ("after", False)])
def test_the_kernel_s_router_chooses_and_weighs_as_the_module(softmax, renormalise):
    from tformer.kernels import library

    moe = mixture(softmax=softmax, renormalise=renormalise, bias=softmax == "after")
    bound = moe.tformer_moe()
    x = torch.randn(5, D)
    ids = torch.empty(5, K, dtype=torch.int64)
    weights = torch.empty(5, K)
    lib = library.load()
    assert lib.tformer_route(ctypes.byref(bound.struct.router), x.data_ptr(), 5,
                             ids.data_ptr(), weights.data_ptr(), 1) == 0
    with torch.no_grad():
        experts, expected = moe.router(x)
    assert torch.equal(ids, experts)
    assert (weights - expected).abs().max() < 1e-6


def tiny_moe(**fields):
    from tformer.models.gpt import GPT, GPTConfig

    base = {"vocab_size": 40, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64,
            "d_ff": 32, "context": 32, "position": "none", "rotary": True, "qk_norm": True,
            "norm_kind": "rmsnorm", "bias": False, "feedforward": "gated",
            "activation": "silu", "n_expert": 4, "n_expert_active": 2}
    torch.manual_seed(0)
    return GPT(GPTConfig(**(base | fields))).eval()


@pytest.mark.parametrize("fields", [{"router_renormalise": True}, {"d_shared_expert": 32},
                                    {"router_softmax": "after"}])
@pytest.mark.parametrize("fmt", [None, "q8_0"])
def test_the_layer_step_decodes_a_mixture_as_the_full_pass(fields, fmt, monkeypatch):
    """step.c runs router and experts: cached decoding through the runner, one token a step,
    equals the full pass, and no mixture module runs at those steps."""
    from tformer.decoding.runner import runner
    from tformer.kernels.step import LMStep

    model = tiny_moe(**fields)
    if fmt is not None:
        model = quantize_model(model, fmt)
    assert LMStep.of(model.blocks) is not None
    run = runner(model)
    tokens = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        cache = run.make_cache(2)
        steps = [run(tokens[:, :4], cache=cache)]
        forward = MixtureOfExperts.forward
        monkeypatch.setattr(MixtureOfExperts, "forward",
                            lambda *a: pytest.fail("a mixture ran as modules"))
        steps += [run(tokens[:, i:i + 1], cache=cache) for i in range(4, 9)]
        monkeypatch.setattr(MixtureOfExperts, "forward", forward)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


@torch.no_grad()
def test_a_paged_pool_steps_a_mixture_in_place_as_the_full_pass(monkeypatch):
    """Rows of different lengths decode together over the paged pool, each step one call a
    block (step.c's paged step, the mixture in it): every row's logits the full pass's."""
    from tformer.decoding.paged import PagedPool, Row

    model = tiny_moe(d_shared_expert=32, router_renormalise=True)
    pool = PagedPool(model, 32, block_size=4)
    assert pool._step is not None
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (5, 9, 2)]
    for text in texts:
        row = Row()
        pool.read_chunk(row, text)
        pool.seat(row)
    for _ in range(4):
        new = torch.randint(0, 40, (len(texts),), generator=g).tolist()
        with monkeypatch.context() as patch:
            patch.setattr(MixtureOfExperts, "forward",
                          lambda *a: pytest.fail("a mixture ran as modules"))
            logits = pool.step(new)
        for i, token in enumerate(new):
            texts[i].append(token)
            want = model(torch.tensor([texts[i]]))[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-5, rtol=1e-5)
