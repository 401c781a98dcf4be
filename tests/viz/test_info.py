"""`tformer info`: parameter counts against the weights, FLOPs against torch's own counter
(torch.utils.flop_counter, with the math attention kernel so that attention's products
are counted too, and without tformer's decoding-step attention kernel and one-call decoder
layers, which torch cannot see into), activation memory against the allocator's view of
saved tensors."""

import json
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tformer.cli import main
from tformer.config import config_from_dict
from tformer.decoding import cache as decoding_cache
from tformer.kernels import matvec
from tformer.kernels.step import DecoderStep
from tformer.models.transformer_xl import Memory
from tformer.registry import get_family
from tformer.viz.cost import activation_bytes
from tformer.viz.info import parameters_by_module, summarize


def counted(fn) -> int:
    matvec.load()  # its checks at load time run products of their own: not inside the count
    with (sdpa_kernel(SDPBackend.MATH),
          mock.patch.object(decoding_cache, "serves", lambda q: False),
          mock.patch.object(DecoderStep, "of", lambda *a: None),
          FlopCounterMode(display=False) as counter):
        fn()
    return counter.get_total_flops()


def build(family, model, data=(), train=()):
    cfg = config_from_dict({"model": {"family": family, **model}, "data": dict(data),
                            "train": dict(train)})
    return cfg, get_family(family).model(cfg.model)


def test_gpt_flops_match_torchs_count():
    cfg, model = build("gpt", {"vocab_size": 40, "context": 12, "n_layer": 2, "n_head": 2,
                               "d_model": 16, "d_ff": 24, "d_value": 5})
    cost = get_family("gpt").cost(cfg)
    T = 12
    tokens = torch.randint(0, 40, (1, T))
    assert counted(lambda: model(tokens).sum().backward()) == pytest.approx(
        T * cost.train_flops)

    def decode():  # generate T tokens one at a time with the KV cache
        model.eval()
        cache = model.make_cache(1)
        with torch.no_grad():
            for t in range(T):
                model(tokens[:, t : t + 1], cache=cache, last_only=True)

    assert counted(decode) == pytest.approx(T * cost.decode_flops)


def test_seq2seq_flops_match_torchs_count():
    cfg, model = build("seq2seq", {"vocab_size": 30, "max_len": 20, "n_layer": 2,
                                   "n_decoder_layer": 1, "n_head": 2, "d_model": 16,
                                   "d_ff": 24}, {"max_len": 10, "max_tokens": 100})
    cost = get_family("seq2seq").cost(cfg)
    L = 10
    assert cost.length == L and cost.batch == 10
    src, tgt = torch.randint(0, 30, (1, L)), torch.randint(0, 30, (1, L))
    real = torch.ones_like(src, dtype=torch.bool)
    assert counted(lambda: model(src, real, tgt).sum().backward()) == pytest.approx(
        L * cost.train_flops)

    def greedy():  # encode once, then L steps with the cache
        model.eval()
        with torch.no_grad():
            memory = model.encode(src, real)
            cache = model.make_cache(1, L)
            for t in range(L):
                model.decode(tgt[:, t : t + 1], memory, real, cache=cache)

    assert counted(greedy) == pytest.approx(L * cost.decode_flops)


def test_transformer_xl_training_flops_match_torchs_count():
    cfg, model = build("transformer-xl", {"vocab_size": 30, "context": 6, "mem_len": 9,
                                          "n_layer": 2, "n_head": 2, "d_model": 16,
                                          "d_ff": 24})
    cost = get_family("transformer-xl").cost(cfg)
    memory = Memory(9)
    tokens = torch.randint(0, 30, (1, 12))
    with torch.no_grad():
        model(tokens[:, :6], memory=memory)
        model(tokens[:, :6], memory=memory)  # 12 positions seen: the memory is full
    assert memory.length == 9
    flops = counted(lambda: model(tokens[:, 6:], memory=memory).sum().backward())
    assert flops == pytest.approx(6 * cost.train_flops)


def test_activation_bytes_are_what_the_allocator_holds_for_backward():
    """Independent check: the memory the CPU allocator still holds after the forward pass,
    beyond the weights, once the loss is dropped and only autograd's saved tensors keep
    memory alive."""
    cfg, model = build("gpt", {"vocab_size": 40, "context": 32, "n_layer": 2, "n_head": 2,
                               "d_model": 64, "d_ff": 128}, train={"batch_size": 3})
    cost = get_family("gpt").cost(cfg)
    measured = activation_bytes(model, cost.example, torch.device("cpu"))
    # The loss's graph holds every saved tensor: their sizes, by their storages.
    loss = cost.example(model, torch.device("cpu"))
    storages, stack = {}, [loss.grad_fn]
    seen = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                if isinstance(value, torch.Tensor):
                    s = value.untyped_storage()
                    storages[s.data_ptr()] = s.nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    independent = sum(n for ptr, n in storages.items() if ptr not in weights)
    assert measured == independent
    assert measured > 2 * 32 * 64 * 4  # at least a few (T, D) fp32 activations per layer


def test_parameters_count_a_tied_embedding_once(runs):
    info = summarize(runs["seq2seq"])
    weights = load_file(str(runs["seq2seq"] / "best" / "model.safetensors"))
    # The file stores tied tensors once; its tensors' sizes are the distinct parameters.
    assert info["parameters"]["total"] == sum(t.numel() for t in weights.values())
    assert sum(info["parameters"]["by_module"].values()) == info["parameters"]["total"]
    assert "tgt_embed" not in info["parameters"]["by_module"]

    cfg, untied = build("seq2seq", {"vocab_size": 34, "max_len": 40, "n_layer": 1,
                                    "n_head": 2, "d_model": 32, "d_ff": 64,
                                    "tie_embeddings": False})
    by_module = parameters_by_module(untied)
    assert by_module["tgt_embed"] == by_module["src_embed"] == by_module["out_proj"] == 34 * 32


def test_summary_holds_step_metrics_tokenizer_and_memory(runs):
    info = summarize(runs["seq2seq"])
    assert info["family"] == "seq2seq" and info["step"] == 6
    assert info["config"]["data.val_bleu_every"] == 1
    assert set(info["validation"]) == {"loss", "bleu", "chrf"}
    assert info["tokenizer"]["kind"] == "char"
    memory = info["memory_bytes"]
    assert memory["weights"] == 4 * info["parameters"]["total"]
    assert memory["optimizer_state"] == 2 * memory["weights"]
    assert memory["activations"] > 0
    assert info["flops_per_token"]["training"] > info["flops_per_token"]["decoding"] > 0


def test_the_command_prints_tables_or_json(runs, capsys):
    assert main(["info", str(runs["a"])]) == 0
    out = capsys.readouterr().out
    assert "parameters (shared tensors once)" in out and "FLOPs per token" in out
    assert main(["info", str(runs["a"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "gpt" and info["step"] == 12
    assert main(["info", "/no/such/run"]) == 2
    assert "not found" in capsys.readouterr().err


def test_transformer_xl_decoding_flops_match_torchs_count():
    cfg, model = build("transformer-xl", {"vocab_size": 30, "context": 6, "mem_len": 9,
                                          "n_layer": 2, "n_head": 2, "d_model": 16,
                                          "d_ff": 24})
    cost = get_family("transformer-xl").cost(cfg)
    model.eval()
    memory = Memory(9, cache_keys=True)
    tokens = torch.randint(0, 30, (1, 14))
    with torch.no_grad():
        for start in range(0, 12, 6):  # fill the memory
            model(tokens[:, start : start + 6], memory=memory)
        model(tokens[:, 12:13], memory=memory, last_only=True)  # position keys now cached
    assert memory.length == 9
    # Frozen weights rather than no_grad: the flop counter's module tracker trips over
    # views of parameters (u[b], v[b]) made under no_grad.
    model.requires_grad_(False)
    flops = counted(lambda: model(tokens[:, 13:14], memory=memory, last_only=True))
    assert flops == pytest.approx(cost.decode_flops)


def test_the_cadence_options_are_checked():
    from tformer.errors import TformerError

    with pytest.raises(TformerError, match="data.val_bleu_every = -1 must be at least 0"):
        build("seq2seq", {}, {"val_bleu_every": -1})
    with pytest.raises(TformerError, match="train.patience = -2 must be at least 0"):
        build("gpt", {}, train={"patience": -2})
