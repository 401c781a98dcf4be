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
