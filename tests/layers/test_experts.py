"""The mixture-of-experts feed-forward against a float64 reference written out plainly: every
expert run on every token, the router's top k picked by sorting each token's scores in
Python, the rest weighted zero."""

from __future__ import annotations

import math

import pytest
import torch

from tformer.errors import TformerError
from tformer.kernels import library
from tformer.layers import GatedFeedForward
from tformer.layers.experts import Experts, MixtureOfExperts, Router, make_glu
from tformer.models.gpt import GPT, GPTConfig

D, F, E, K = 16, 12, 5, 2


def reference(moe: MixtureOfExperts, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """(N, D) float64 -> the mixture's outputs and each token's chosen experts (best first),
    differentiable with respect to the mixture's parameters."""
    p = {name: t.double() for name, t in moe.named_parameters()}
    router = moe.router
    out, chosen = [], []
    for row in x:
        scores = p["router.weight"] @ row
        ranked = sorted(range(len(scores)), key=lambda e: -scores[e].item())[: router.k]
        if router.softmax == "before":
            probs = torch.softmax(scores, 0)
            weights = [probs[e] for e in ranked]
            if router.renormalise:
                weights = [w / sum(weights) for w in weights]
        else:
            weights = list(torch.softmax(scores[ranked], 0))
        y = 0
        for w, e in zip(weights, ranked, strict=True):
            g, u = p["experts.gate"][e] @ row, p["experts.up"][e] @ row
            y += w * (p["experts.down"][e] @ (g * torch.sigmoid(g) * u))
        if moe.shared is not None:
            g, u = p["shared.gate.weight"] @ row, p["shared.up.weight"] @ row
            shared = p["shared.down.weight"] @ (g * torch.sigmoid(g) * u)
            y += torch.sigmoid(p["shared_gate"] @ row) * shared
        out.append(y)
        chosen.append(ranked)
    return torch.stack(out), chosen


def make_mixture(d: int, f: int, *, softmax="before", renormalise=False, d_shared=0,
                 glu="gated", bias=False, balance=0.0) -> MixtureOfExperts:
    router = Router(d, E, K, softmax=softmax, renormalise=renormalise, bias=bias)
    experts = Experts(d, f, E, glu=make_glu(glu, "silu", 7.0, 1.702), bias=bias)
    shared = GatedFeedForward(d, d_shared, activation="silu", bias=False) if d_shared else None
    return MixtureOfExperts(router, experts, shared, balance=balance)


def mixture(seed=0, **options) -> MixtureOfExperts:
    torch.manual_seed(seed)
    moe = make_mixture(D, F, **options)
    with torch.no_grad():  # weights large enough that the router's scores are far apart
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return moe


KINDS = {"qwen3": {"renormalise": True}, "qwen2-shared": {"d_shared": 8},
         "softmax-after": {"softmax": "after"}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_mixture_matches_a_dense_float64_reference(kind):
    moe = mixture(**KINDS[kind])
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        expected, chosen = reference(moe, x.reshape(-1, D).double())
    assert (moe(x).reshape(-1, D).double() - expected).abs().max() < 1e-5
    experts, _ = moe.router(x.reshape(-1, D))
    assert experts.tolist() == chosen
    # One token alone takes the decoding path (its k experts in turn): the same outputs.
    for i in range(3):
        one = moe(x[0, i][None, None]).reshape(D)
        assert (one.double() - expected[i]).abs().max() < 1e-5


def test_gradients_match_the_reference():
    """Backward through the grouped dispatch against autograd through the reference's loops,
    run on a twin with the same weights."""
    moe, twin = mixture(d_shared=8, renormalise=True), mixture(d_shared=8, renormalise=True)
    x = torch.randn(9, D, requires_grad=True)
    moe(x[None]).square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    expected, _ = reference(twin, x64)
    expected.square().sum().backward()
    assert (x.grad.double() - x64.grad).abs().max() < 1e-4
    twin_params = dict(twin.named_parameters())
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert (p.grad - twin_params[name].grad).abs().max() < 1e-4, name


@pytest.mark.parametrize("options", [{"d_shared": 8}, {"glu": "clamped", "bias": True}])
def test_split_experts_compute_the_same(options):
    moe = mixture(**options)
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        expected = moe(x)
        moe.experts = moe.experts.as_linears()
        assert torch.allclose(moe(x), expected, atol=1e-6)


def tiny_moe(**fields) -> GPT:
    base = {"vocab_size": 40, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 32,
            "d_ff": 16, "context": 32, "position": "none", "rotary": True,
            "norm_kind": "rmsnorm", "bias": False, "feedforward": "gated",
            "activation": "silu", "n_expert": 4, "n_expert_active": 2}
    cfg = GPTConfig(**(base | fields))
    torch.manual_seed(0)
    return GPT(cfg).eval()


@torch.no_grad()
def test_cached_decoding_equals_the_full_pass():
    model = tiny_moe(d_shared_expert=16)
    tokens = torch.randint(0, 40, (2, 9))
    full = model(tokens)
    cache = model.make_cache(2)
    steps = [model(tokens[:, :4], cache=cache)]
    steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(4, 9)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_a_tiny_mixture_learns():
    model = tiny_moe().train()
    tokens = torch.arange(24).remainder(6)[None].repeat(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert model.blocks[0].ff.router.weight.grad.abs().sum() > 0  # the router learns too
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0] and losses[0] > 0.5 * math.log(40)


@pytest.mark.parametrize("fields, message", [
    ({"feedforward": "plain"}, "needs model.feedforward = 'gated'"),
    ({"n_expert_active": 5}, "model.n_expert_active"),
    ({"router_softmax": "never"}, "model.router_softmax"),
])
def test_bad_expert_fields_are_named(fields, message):
    base = {"vocab_size": 10, "feedforward": "gated", "n_expert": 4}
    with pytest.raises(TformerError, match=message):
        GPTConfig(**(base | fields))


def test_expert_fields_are_moot_without_experts():
    assert {"n_expert_active", "d_shared_expert"} <= GPTConfig().unused_fields()
    assert "n_expert_active" not in GPTConfig(feedforward="gated", n_expert=2).unused_fields()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1"])
@torch.no_grad()
def test_weight_formats_give_each_expert_its_own_blocks(fmt):
    """quantize_model splits the stacked experts into a layer of the format each; the result
    is the float64 reference over the rounded weights (the format's layers' own `weight`),
    up to the rounding of the activations (8 bits)."""
    from tformer.kernels.formats import quantize_model, weight_format

    moe = make_mixture(32, 64, d_shared=32, renormalise=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    quantized = quantize_model(moe, fmt)
    made = type(weight_format(fmt).quantize(torch.nn.Linear(32, 32, bias=False)))
    split = quantized.experts
    assert made is not torch.nn.Linear and len(split.gate) == E
    assert all(type(layer) is made for p in (split.gate, split.up, split.down) for layer in p)
    assert moe.experts.gate.dim() == 3  # the original is left as it was
    assert quantized.router.weight is moe.router.weight  # routers stay fp32

    rounded = make_mixture(32, 64, d_shared=32, renormalise=True).double()
    rounded.load_state_dict(moe.state_dict())
    for p in ("gate", "up", "down"):
        getattr(rounded.experts, p).copy_(torch.stack([m.weight for m in getattr(split, p)]))
        getattr(rounded.shared, p).weight.copy_(getattr(quantized.shared, p).weight)
    x = torch.randn(11, 32)
    expected, _ = reference(rounded, x.double())
    got = quantized(x[None])[0].double()
    assert (got - expected).norm() / expected.norm() < 0.02
    # One token at a time (decoding reads the chosen experts' blocks alone): the same.
    one = quantized(x[:1, None])[0].double()
    assert (one - expected[:1]).norm() / expected[:1].norm() < 0.02


@pytest.mark.skipif(library.load() is None, reason="the C kernels are not in use here")
def test_the_one_call_step_kernel_takes_mixtures_it_can_run():
    """step.c runs a mixture's router and experts (experts.c) as well as a dense
    feed-forward; one whose gate it does not compute runs as modules."""
    from tformer.kernels.step import LMStep

    assert LMStep.of(tiny_moe().blocks) is not None
    assert LMStep.of(tiny_moe(activation="gelu").blocks) is None


def test_lora_adapts_a_mixture_s_attention_and_leaves_the_experts_frozen():
    from tformer.config import LoRAConfig
    from tformer.training.lora import add_adapters, merge

    model = tiny_moe(d_shared_expert=16).train()
    names = add_adapters(model, LoRAConfig(r=2, targets=["qkv_proj", "out_proj"]))
    assert sorted(names) == [f"blocks.{i}.attn.{p}" for i in range(2)
                             for p in ("out_proj", "qkv_proj")]
    tokens = torch.randint(0, 40, (2, 8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all(".lora_" in n for n in trained)
    model.eval()
    with torch.no_grad():
        adapted = model(tokens)
        assert (merge(model)(tokens) - adapted).abs().max() < 1e-5
    # "all" reaches the shared expert's linear layers, never the router or stacked experts.
    other = tiny_moe(d_shared_expert=16)
    everything = add_adapters(other, LoRAConfig(r=2))
    assert "blocks.0.ff.shared.up" in everything
    assert not any("router" in n or "experts" in n for n in everything)


def test_one_token_reads_only_its_chosen_experts(monkeypatch):
    """Decoding a token runs its k experts and no other: no dense pass over all E."""
    from tformer.layers.experts import Experts

    moe = mixture()
    called = []
    run = Experts.expert
    monkeypatch.setattr(Experts, "expert",
                        lambda self, e, x: called.append((e, x.shape[0])) or run(self, e, x))
    x = torch.randn(1, 1, D)
    with torch.no_grad():
        moe(x)
        chosen, _ = moe.router(x[0])
    assert called == [(e, 1) for e in chosen[0].tolist()]
    called.clear()
    with torch.no_grad():  # many tokens: one call an expert, over the tokens routed to it
        moe(torch.randn(1, 12, D))
    assert len({e for e, _ in called}) == len(called) and sum(n for _, n in called) == 12 * K


@torch.no_grad()
def test_gpt_oss_experts_match_transformers():
    """Router bias, softmax after top-k, biased experts and the clamped gate against
    transformers' own GptOssMLP with the same weights (its gate and up interleaved in one
    [E, D, 2F] tensor, stored input-first)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                       num_experts_per_tok=K)
    theirs = GptOssMLP(config).eval()
    torch.manual_seed(1)
    for p in theirs.parameters():
        p.copy_(torch.randn(p.shape) * 0.5)  # gates beyond the clamp's limit of 7 too
    ours = make_mixture(D, F, softmax="after", glu="clamped", bias=True)
    gate_up, gate_up_bias = theirs.experts.gate_up_proj, theirs.experts.gate_up_proj_bias
    state = {"router.weight": theirs.router.weight, "router.bias": theirs.router.bias,
             "experts.gate": gate_up[..., ::2].transpose(1, 2),
             "experts.up": gate_up[..., 1::2].transpose(1, 2),
             "experts.down": theirs.experts.down_proj.transpose(1, 2),
             "experts.gate_bias": gate_up_bias[:, ::2], "experts.up_bias": gate_up_bias[:, 1::2],
             "experts.down_bias": theirs.experts.down_proj_bias}
    ours.load_state_dict(state)
    x = torch.randn(2, 6, D) * 3
    expected, _ = theirs(x)
    assert (ours(x) - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(ours.router(x.reshape(-1, D))[0], theirs.router(x.reshape(-1, D))[2])
    clamped = ours.experts.glu(torch.tensor([9.0, -9.0]), torch.tensor([9.0, -9.0]))
    assert clamped[0] > 7.0 * 7.9 and clamped[1].abs() < 1e-3  # the limits do bite


def test_a_mixture_trains_and_generates_through_the_cli(tiny_config, tmp_path, capsys):
    """The [model] table is all it takes: train, then generate with blocks for the experts."""
    from tformer.cli import main
    from tformer.loading import load_checkpoint

    config = tiny_config(model={"d_model": 32, "feedforward": "gated", "activation": "silu",
                                "n_expert": 4, "n_expert_active": 2, "router_balance": 0.01},
                         lr=3e-3)
    assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 0
    loaded = load_checkpoint(tmp_path / "run")
    assert isinstance(loaded.model.blocks[0].ff, MixtureOfExperts)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "First", "--weights", "q8_0",
                 "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("First")


def test_the_balance_loss_joins_the_gradients_and_not_the_outputs():
    """With router_balance b, backward minimises outputs' loss + b * E * sum_e f_e P_e
    (written out here with Python loops), and the outputs are the same."""
    moe, twin = mixture(balance=0.3), mixture()
    x = torch.randn(10, D)
    out = moe(x[None])
    out.square().sum().backward()
    plain = twin(x[None])
    assert torch.equal(out, plain)
    probs = torch.softmax(x @ twin.router.weight.T, -1)
    chosen = [sorted(range(E), key=lambda e: -row[e].item())[:K] for row in probs.detach()]
    balance = 0
    for e in range(E):
        share = sum(e in c for c in chosen) / (len(chosen) * K)
        balance = balance + share * probs[:, e].mean()
    (plain.square().sum() + 0.3 * E * balance).backward()
    assert (moe.router.weight.grad - twin.router.weight.grad).abs().max() < 1e-4
    assert (moe.experts.gate.grad - twin.experts.gate.grad).abs().max() < 1e-4
    # ...which the balance term does change: without it the router's gradient differs.
    alone = mixture()
    alone(x[None]).square().sum().backward()
    assert (alone.router.weight.grad - moe.router.weight.grad).abs().max() > 1e-3
    moe.eval()  # and not at inference
    with torch.no_grad():
        assert torch.equal(moe(x[None]), twin.eval()(x[None]))
