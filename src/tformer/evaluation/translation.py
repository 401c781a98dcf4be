"""Translation metrics: BLEU and chrF with sacrebleu, and the loss per target token.

BLEU and chrF are computed by sacrebleu on detokenized hypotheses against the raw reference
lines (Post 2018), with its default settings (13a tokenization for BLEU), so the figures and
their signatures compare with published ones. Beside it, `bleu_tok` is BLEU as the Multi30k
literature reports it (multi-bleu.perl -lc style): on Moses-tokenized, lowercased text, with
no further tokenization. It is usually a few points higher than the detokenized, cased
figure, and only comparable with papers that computed it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tformer.data.parallel import encode_source, encode_target, sorted_batches
from tformer.data.tokenizers import Tokenizer
from tformer.decoding.translate import SearchOptions, best_translations
from tformer.errors import TformerError
from tformer.evaluation.loss import Targets
from tformer.evaluation.shard import WHOLE, Shard


def corpus_scores(
    hypotheses: Sequence[str], references: Sequence[str], *, lang: str = "en"
) -> dict[str, float | str]:
    """Corpus BLEU and chrF of one hypothesis per reference, with sacrebleu's signatures,
    the literature-style tokenized BLEU (lang: the target language, for the Moses
    tokenizer's rules), and the fraction of hypotheses equal to their reference (for tasks
    with one right answer)."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise TformerError(
            f"{len(hypotheses)} hypotheses for {len(references)} references; they must pair up"
        )
    bleu, chrf = BLEU(), CHRF()
    exact = sum(h == r for h, r in zip(hypotheses, references, strict=True))
    bleu_tok, bleu_tok_signature = tokenized_bleu(hypotheses, references, lang)
    return {
        "bleu": bleu.corpus_score(list(hypotheses), [list(references)]).score,
        "chrf": chrf.corpus_score(list(hypotheses), [list(references)]).score,
        "bleu_tok": bleu_tok,
        "exact_match": exact / max(len(hypotheses), 1),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_tok_signature": bleu_tok_signature,
    }


def tokenized_bleu(
    hypotheses: Sequence[str], references: Sequence[str], lang: str = "en"
) -> tuple[float, str]:
    """BLEU on Moses-tokenized (sacremoses, no escaping), lowercased text, scored without
    further tokenization; its signature is sacrebleu's with the Moses step in front."""
    from sacrebleu.metrics import BLEU
    from sacremoses import MosesTokenizer

    moses = MosesTokenizer(lang=lang)

    def tokenize(lines: Sequence[str]) -> list[str]:
        return [moses.tokenize(line, escape=False, return_str=True) for line in lines]

    bleu = BLEU(tokenize="none", lowercase=True, force=True)
    score = bleu.corpus_score(tokenize(hypotheses), [tokenize(references)]).score
    return score, f"moses-tok:{lang}|{bleu.get_signature()}"


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    src: list[list[int]],
    tgt: list[list[int]],
    tokenizer: Tokenizer,
    max_tokens: int,
    max_batches: int = 0,
    shard: Shard = WHOLE,
) -> dict[str, float]:
    """Cross-entropy per target token (nats, no label smoothing) of encoded pairs, EOS
    included, with teacher forcing. `shard`: this process's rows of each batch, the sums
    then added over processes."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, n_tokens = 0.0, 0
    for i, batch in enumerate(sorted_batches(src, tgt, tokenizer, max_tokens)):
        if max_batches and i >= max_batches:
            break
        batch, counts = shard.rows(batch)
        batch = batch.to(device)
        targets = Targets(batch.tgt_out, reduction="sum")
        nll = float(targets.score(model, batch.src, batch.src_real, batch.tgt_in))
        if counts:
            total += nll
            n_tokens += batch.num_tokens
    model.train(was_training)
    total, n_tokens = shard.total(total, n_tokens)
    return {"loss": total / max(n_tokens, 1), "tokens": int(n_tokens)}


def evaluate_translation(
    model: nn.Module,
    tokenizer: Tokenizer,
    sources: Sequence[str],
    references: Sequence[str],
    options: SearchOptions | None = None,
    *,
    batch_size: int = 32,
    max_tokens: int = 4000,
    progress=None,
    lang: str = "en",
) -> tuple[dict[str, float | str], list[str]]:
    """BLEU, chrF and loss of a model on source lines and their reference translations
    (in language `lang`); also returns the hypotheses."""
    if len(sources) != len(references):
        raise TformerError(
            f"{len(sources)} source lines and {len(references)} reference lines; they must "
            f"pair up line by line"
        )
    hypotheses = best_translations(
        model, tokenizer, sources, options, batch_size=batch_size, progress=progress
    )
    result: dict[str, float | str] = {}
    scores = corpus_scores(hypotheses, references, lang=lang)
    limit = model.cfg.max_len
    src_ids = [ids[:limit] for ids in encode_source(tokenizer, sources)]
    tgt_ids = [ids[:limit] for ids in encode_target(tokenizer, references)]
    loss = evaluate_loss(model, src_ids, tgt_ids, tokenizer, max_tokens)
    result.update(bleu=scores["bleu"], chrf=scores["chrf"], bleu_tok=scores["bleu_tok"],
                  loss=loss["loss"], exact_match=scores["exact_match"], sentences=len(sources),
                  bleu_signature=scores["bleu_signature"],
                  chrf_signature=scores["chrf_signature"],
                  bleu_tok_signature=scores["bleu_tok_signature"])
    return result, hypotheses
