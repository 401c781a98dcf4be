import pytest
import sacrebleu

from tformer.errors import TformerError
from tformer.evaluation.translation import corpus_scores

REFS = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


def test_scores_are_sacrebleus_on_raw_text():
    hyps = ["Ein Mann fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee."]
    scores = corpus_scores(hyps, REFS)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [REFS]).score)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [REFS]).score)
    assert scores["exact_match"] == 0.5
    assert "tok:13a" in scores["bleu_signature"]


def test_a_perfect_translation_scores_100():
    scores = corpus_scores(REFS, REFS)
    assert scores["bleu"] == pytest.approx(100.0) and scores["exact_match"] == 1.0


def test_unpaired_lines_are_an_error():
    with pytest.raises(TformerError, match="1 hypotheses for 2 references"):
        corpus_scores(["x"], REFS)


def naive_bleu(hyps: list[list[str]], refs: list[list[str]]) -> float:
    """Corpus BLEU-4 (Papineni et al. 2002) counted by hand: clipped n-gram precisions,
    their geometric mean, and the brevity penalty."""
    import math
    from collections import Counter

    log_precision = 0.0
    for n in range(1, 5):
        matched = total = 0
        for h, r in zip(hyps, refs, strict=True):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matched += sum(min(c, r_grams[g]) for g, c in h_grams.items())
            total += sum(h_grams.values())
        log_precision += math.log(matched / total) / 4
    h_len, r_len = sum(map(len, hyps)), sum(map(len, refs))
    brevity = min(0.0, 1 - r_len / h_len)
    return 100 * math.exp(log_precision + brevity)


def test_literature_bleu_is_bleu_on_moses_tokens_lowercased():
    hyps = ["Ein Mann fährt ein rotes Fahrrad.", "Zwei Hunde spielen im tiefen Schnee!"]
    refs = ["ein Mann fährt ein Fahrrad.", "Zwei Hunde spielen im Schnee!"]
    # The Moses tokenizer splits the final punctuation off; case is folded by hand here.
    tokens = [["ein", "mann", "fährt", "ein", "rotes", "fahrrad", "."],
              ["zwei", "hunde", "spielen", "im", "tiefen", "schnee", "!"]]
    ref_tokens = [["ein", "mann", "fährt", "ein", "fahrrad", "."],
                  ["zwei", "hunde", "spielen", "im", "schnee", "!"]]
    scores = corpus_scores(hyps, refs, lang="de")
    assert scores["bleu_tok"] == pytest.approx(naive_bleu(tokens, ref_tokens))
    assert scores["bleu_tok"] > scores["bleu"]  # the cased score loses "ein"/"Ein"
    assert scores["bleu_tok_signature"].startswith("moses-tok:de|")
    assert "case:lc" in scores["bleu_tok_signature"] and "tok:none" in scores[
        "bleu_tok_signature"]


def test_literature_bleu_ignores_case_and_spacing_of_punctuation():
    scores = corpus_scores(["EIN MANN FÄHRT FAHRRAD ."], ["Ein Mann fährt Fahrrad."])
    assert scores["bleu_tok"] == pytest.approx(100.0) and scores["bleu"] < 100
