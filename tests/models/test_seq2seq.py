import math

import pytest
import torch
import torch.nn.functional as F

from tformer.data.tokenizers import IGNORE_INDEX
from tformer.errors import TformerError
from tformer.evaluation.loss import label_smoothed_loss
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

V = 19


def tiny(**changes) -> Seq2Seq:
    cfg = Seq2SeqConfig(
        **{"vocab_size": V, "max_len": 32, "n_layer": 2, "n_head": 2, "d_model": 16,
           "d_ff": 32, "dropout": 0.0, **changes}
    )
    return Seq2Seq(cfg).eval()


def test_tied_weights_are_one_tensor():
    model = tiny()
    assert model.src_embed.weight is model.tgt_embed.weight is model.out_proj.weight
    untied = tiny(tie_embeddings=False)
    assert model.num_params() == untied.num_params() - 2 * V * 16
    assert untied.src_embed.weight.data_ptr() != untied.out_proj.weight.data_ptr()


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_padding_the_source_never_changes_the_encoder_at_real_positions(norm):
    model = tiny(norm=norm)
    src = torch.randint(3, V, (1, 7))
    alone = model.encode(src, torch.ones_like(src, dtype=torch.bool))
    for pad in (1, 5, 20):
        padded = torch.cat([src, torch.zeros(1, pad, dtype=torch.long)], dim=1)
        real = torch.arange(padded.shape[1])[None] < 7
        out = model.encode(padded, real)
        torch.testing.assert_close(out[:, :7], alone, atol=1e-6, rtol=1e-5)


def test_padding_the_source_never_changes_the_decoder_output():
    model = tiny()
    src, tgt = torch.randint(3, V, (1, 6)), torch.randint(3, V, (1, 5))
    alone = model(src, torch.ones_like(src, dtype=torch.bool), tgt)
    padded = torch.cat([src, torch.zeros(1, 9, dtype=torch.long)], dim=1)
    out = model(padded, torch.arange(15)[None] < 6, tgt)
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_decoder_is_causal():
    """Changing target token t changes no logits before t."""
    model = tiny()
    src = torch.randint(3, V, (2, 6))
    real = torch.ones_like(src, dtype=torch.bool)
    tgt = torch.randint(3, V, (2, 8))
    changed = tgt.clone()
    changed[:, 5] = (changed[:, 5] + 1) % V
    a, b = model(src, real, tgt), model(src, real, changed)
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("changes", [{}, {"norm": "post"}, {"d_head": 5, "d_value": 7},
                                     {"activation": "gelu", "tie_embeddings": False}])
def test_cached_decoding_equals_uncached(changes):
    model = tiny(**changes)
    src = torch.randint(3, V, (3, 6))
    real = torch.ones_like(src, dtype=torch.bool)
    real[1, 4:] = False
    tgt = torch.randint(3, V, (3, 9))
    memory = model.encode(src, real)
    full = model.decode(tgt, memory, real)
    cache = model.make_cache(3, 9)
    steps = [model.decode(tgt[:, t : t + 1], memory, real, cache=cache) for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_beams_share_the_memory_of_their_sentence():
    """A decoder batch of B * K rows reads a memory of B rows as a view, with the same result
    as the memory repeated."""
    model = tiny()
    src = torch.randint(3, V, (2, 5))
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    memory = model.encode(src, real)
    tgt = torch.randint(3, V, (6, 4))
    shared = model.decode(tgt, memory, real)
    repeated = model.decode(
        tgt, memory.repeat_interleave(3, dim=0), real.repeat_interleave(3, dim=0)
    )
    torch.testing.assert_close(shared, repeated)


def test_head_sizes_apart_from_d_model():
    model = tiny(d_head=3, d_value=11, n_head=4)
    attn = model.decoder[0].cross_attn
    assert attn.q_proj.weight.shape == (12, 16)
    assert attn.kv_proj.weight.shape == (12 + 44, 16)
    src = torch.randint(3, V, (2, 5))
    out = model(src, torch.ones_like(src, dtype=torch.bool), torch.randint(3, V, (2, 4)))
    assert out.shape == (2, 4, V)


def test_label_smoothed_loss_matches_a_naive_computation():
    logits = torch.randn(2, 4, V)
    targets = torch.randint(0, V, (2, 4))
    targets[1, 2:] = IGNORE_INDEX
    eps = 0.1
    total, n = 0.0, 0
    for b in range(2):
        for t in range(4):
            if targets[b, t] == IGNORE_INDEX:
                continue
            logp = F.log_softmax(logits[b, t], dim=-1)
            q = torch.full((V,), eps / V)
            q[targets[b, t]] += 1 - eps
            total += float(-(q * logp).sum())
            n += 1
    got = label_smoothed_loss(logits, targets, eps)
    assert math.isclose(float(got), total / n, rel_tol=1e-5)
    plain = label_smoothed_loss(logits, targets, 0.0)
    assert math.isclose(
        float(plain), float(F.cross_entropy(logits.flatten(0, 1), targets.flatten())),
        rel_tol=1e-5,
    )


@pytest.mark.parametrize(
    "changes, message",
    [({"norm": "middle"}, "model.norm = 'middle'"),
     ({"activation": "tanh"}, "relu | gelu"),
     ({"d_model": 10, "n_head": 3}, "model.d_model = 10"),
     ({"label_smoothing": 1.5}, "model.label_smoothing = 1.5")],
)
def test_config_errors_name_the_key_and_the_allowed_values(changes, message):
    with pytest.raises(TformerError, match=message.replace("|", r"\|")):
        Seq2SeqConfig(**changes)
