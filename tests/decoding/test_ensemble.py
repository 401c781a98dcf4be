import pytest
import torch

from tformer.decoding.beam import beam_search, greedy_search
from tformer.decoding.ensemble import Ensemble
from tformer.errors import TformerError
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

PAD, BOS, EOS = 0, 1, 2
SPECIAL = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}
V = 23


def tiny(seed: int, **shape) -> Seq2Seq:
    torch.manual_seed(seed)
    cfg = Seq2SeqConfig(**{"vocab_size": V, "max_len": 40, "n_layer": 2, "n_head": 2,
                           "d_model": 16, "d_ff": 32, "dropout": 0.0, **shape})
    model = Seq2Seq(cfg).eval()
    with torch.no_grad():  # sharper distributions than at initialisation: fewer near-ties
        model.out_proj.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def members() -> list[Seq2Seq]:
    # Different shapes and position limits: an ensemble needs only the vocabulary shared.
    return [tiny(0), tiny(1, n_layer=1, d_model=24, max_len=30)]


def sources(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, V, (int(k),), generator=g).tolist() + [EOS]
            for k in torch.randint(1, 12, (n,), generator=g)]
    src = torch.full((n, max(map(len, seqs))), PAD)
    for i, s in enumerate(seqs):
        src[i, : len(s)] = torch.tensor(s)
    return src, src != PAD, seqs


def mean_distribution(members, src, real, tgt) -> torch.Tensor:
    """log((P_1 + ... + P_M) / M) from each model's full teacher-forced pass."""
    with torch.no_grad():
        probs = [torch.softmax(m(src, real, tgt), dim=-1) for m in members]
    return torch.log(sum(probs) / len(probs))


def test_the_ensemble_is_the_mean_of_its_models_distributions(members):
    src, real, _ = sources(4, seed=1)
    tgt = torch.randint(3, V, (4, 7), generator=torch.Generator().manual_seed(2))
    tgt[:, 0] = BOS
    ensemble = Ensemble(members)
    with torch.no_grad():
        got = ensemble(src, real, tgt)
    torch.testing.assert_close(got, mean_distribution(members, src, real, tgt), atol=1e-5,
                               rtol=0)
    assert ensemble.cfg.max_len == 30


def test_cached_ensemble_decoding_equals_full_passes(members):
    src, real, _ = sources(6, seed=3)
    ensemble = Ensemble(members)
    cached = greedy_search(ensemble, src, real, **SPECIAL)
    uncached = greedy_search(ensemble, src, real, use_cache=False, **SPECIAL)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    assert [h.logprob for h in cached] == pytest.approx([h.logprob for h in uncached], abs=1e-4)


def test_ensemble_beam_scores_equal_a_rescoring_with_the_mean_distribution(members):
    src, real, seqs = sources(3, seed=4)
    hyps = beam_search(Ensemble(members), src, real, beam=3, n_best=3, **SPECIAL)
    for seq, nbest in zip(seqs, hyps, strict=True):
        s = torch.tensor([seq])
        for h in nbest:
            logp = mean_distribution(members, s, torch.ones_like(s, dtype=torch.bool),
                                     torch.tensor([[BOS, *h.tokens]]))[0]
            target = torch.tensor([*h.tokens, EOS])
            assert h.logprob == pytest.approx(float(logp.gather(1, target[:, None]).sum()),
                                              abs=1e-3)


def test_ensemble_batched_beam_search_equals_one_sentence_at_a_time(members):
    src, real, seqs = sources(8, seed=5)
    ensemble = Ensemble(members)
    batched = beam_search(ensemble, src, real, beam=4, n_best=2, **SPECIAL)
    for seq, together in zip(seqs, batched, strict=True):
        s = torch.tensor([seq])
        [alone] = beam_search(ensemble, s, torch.ones_like(s, dtype=torch.bool), beam=4,
                              n_best=2, **SPECIAL)
        assert [h.tokens for h in together] == [h.tokens for h in alone]
        assert [h.score for h in together] == pytest.approx([h.score for h in alone], abs=1e-4)


def test_an_ensemble_of_one_decodes_as_the_model_alone(members):
    src, real, _ = sources(5, seed=6)
    alone = beam_search(members[0], src, real, beam=4, **SPECIAL)
    ensemble = beam_search(Ensemble(members[:1]), src, real, beam=4, **SPECIAL)
    assert [h.tokens for [h] in ensemble] == [h.tokens for [h] in alone]
    assert [h.score for [h] in ensemble] == pytest.approx([h.score for [h] in alone], abs=1e-5)


def test_models_with_different_vocabularies_are_refused(members):
    with pytest.raises(TformerError, match="share one vocabulary; these have 23 and 24 tokens"):
        Ensemble([members[0], tiny(2, vocab_size=24)])
