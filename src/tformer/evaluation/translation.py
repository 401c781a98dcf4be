"""Translation metrics: BLEU and chrF with sacrebleu, and the loss per target token.

BLEU and chrF are computed by sacrebleu on detokenized hypotheses against the raw reference
lines (Post 2018), with its default settings (13a tokenization for BLEU), so the figures and
their signatures compare with published ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tformer.data.parallel import encode_source, sorted_batches
from tformer.data.tokenizers import Tokenizer
from tformer.decoding.translate import SearchOptions, best_translations
from tformer.errors import TformerError
from tformer.evaluation.shard import WHOLE, Shard
from tformer.models.seq2seq import label_smoothed_loss


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float | str]:
    """Corpus BLEU and chrF of one hypothesis per reference, with sacrebleu's signatures,
    and the fraction of hypotheses equal to their reference (for tasks with one right
    answer)."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise TformerError(
            f"{len(hypotheses)} hypotheses for {len(references)} references; they must pair up"
        )
    bleu, chrf = BLEU(), CHRF()
    exact = sum(h == r for h, r in zip(hypotheses, references, strict=True))
    return {
        "bleu": bleu.corpus_score(list(hypotheses), [list(references)]).score,
        "chrf": chrf.corpus_score(list(hypotheses), [list(references)]).score,
        "exact_match": exact / max(len(hypotheses), 1),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


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
        logits = model(batch.src, batch.src_real, batch.tgt_in)
        nll = float(label_smoothed_loss(logits, batch.tgt_out, 0.0, reduction="sum"))
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
) -> tuple[dict[str, float | str], list[str]]:
    """BLEU, chrF and loss of a model on source lines and their reference translations;
    also returns the hypotheses."""
    if len(sources) != len(references):
        raise TformerError(
            f"{len(sources)} source lines and {len(references)} reference lines; they must "
            f"pair up line by line"
        )
    hypotheses = best_translations(
        model, tokenizer, sources, options, batch_size=batch_size, progress=progress
    )
    result: dict[str, float | str] = {}
    scores = corpus_scores(hypotheses, references)
    limit = model.cfg.max_len
    src_ids = [ids[:limit] for ids in encode_source(tokenizer, sources)]
    tgt_ids = [ids[:limit] for ids in encode_source(tokenizer, references)]
    loss = evaluate_loss(model, src_ids, tgt_ids, tokenizer, max_tokens)
    result.update(bleu=scores["bleu"], chrf=scores["chrf"], loss=loss["loss"],
                  exact_match=scores["exact_match"], sentences=len(sources),
                  bleu_signature=scores["bleu_signature"],
                  chrf_signature=scores["chrf_signature"])
    return result, hypotheses
