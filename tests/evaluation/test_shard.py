"""Sharded evaluation: the shares of N processes, added up, equal one process's figures."""

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tformer.config import config_from_dict
from tformer.evaluation.lm import lm_metrics
from tformer.evaluation.shard import Shard
from tformer.registry import get_family

FAMILIES = {
    "gpt": ["model.context=16", "train.batch_size=5"],
    "transformer-xl": ["model.context=8", "model.mem_len=8", "train.batch_size=5"],
    "seq2seq": ["data.tokenizer=char", "data.builtin_pairs=200", "data.builtin_max=9999",
                "data.max_tokens=120", "data.max_ratio=12.0", "model.max_len=32",
                "data.max_len=32"],
}


def tiny(family, corpus):
    extra = [] if family == "seq2seq" else [f"data.path={corpus}"]
    cfg = config_from_dict({}, [
        f"model.family={family}", "model.n_layer=1", "model.n_head=2", "model.d_model=16",
        "model.d_ff=32", "model.dropout=0.0", "train.device=cpu", *extra, *FAMILIES[family],
    ])
    fam = get_family(family)
    task = fam.task(cfg)
    torch.manual_seed(0)
    model = fam.model(cfg.replace("model", **task.model_fields()).model).eval()
    return task, model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("count", [2, 3, 7])
def test_shares_add_up_to_the_whole(family, count, tiny_corpus):
    task, model = tiny(family, tiny_corpus)
    whole = task.evaluate(model)
    assert whole["tokens"] > 0
    shares = []
    for index in range(count):
        seen = []

        def keep(totals, seen=seen):
            seen.append(totals.clone())
            return totals

        task.evaluate(model, shard=Shard(index, count, keep))
        shares.append(seen[-1])
    summed = torch.stack(shares).sum(0).tolist()
    assert int(summed[1]) == whole["tokens"], "every target token counted once"
    if family == "seq2seq":
        assert summed[0] / summed[1] == pytest.approx(whole["loss"], rel=1e-5)
    else:
        metrics = lm_metrics(summed[0], int(summed[1]), int(summed[2]))
        assert metrics["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert metrics["bpc"] == pytest.approx(whole["bpc"], rel=1e-5)


def test_a_shard_with_no_rows_still_runs_a_row_that_counts_for_nothing():
    from tformer.data.lm import LMBatch

    batch = LMBatch(torch.arange(6).view(2, 3), torch.arange(6).view(2, 3))
    rows, counts = Shard(2, 3).rows(batch)
    assert not counts and rows.tokens.shape == (1, 3)
    rows, counts = Shard(1, 3).rows(batch)
    assert counts and rows.tokens.tolist() == [[3, 4, 5]]


def run_shards(count, work):
    """work(shard) for every shard at once, each in its own thread, the shards' `gather`
    meeting at a barrier as torch.distributed.all_gather_object's processes do."""
    board, barrier = [None] * count, threading.Barrier(count)

    def gather(index, own):
        board[index] = own
        barrier.wait()
        return list(board)

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(work, Shard(i, count, gather=functools.partial(gather, i)))
                   for i in range(count)]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("count,n", [(2, 7), (3, 7), (3, 2), (4, 0)])
def test_map_gives_every_shard_the_results_in_the_order_of_the_items(count, n):
    items, calls = list(range(n)), []

    def square(part):
        calls.append(list(part))
        return [x * x for x in part]

    for result in run_shards(count, lambda shard: shard.map(square, items)):
        assert result == [x * x for x in items]
    assert sorted(x for part in calls for x in part) == items, "each item mapped once"


def test_map_without_gather_does_all_the_work_on_every_shard():
    assert Shard(1, 3).map(lambda part: [-x for x in part], [1, 2, 3]) == [-1, -2, -3]


def test_validation_bleu_split_between_shards_scores_as_one_process(tiny_corpus):
    task, model = tiny("seq2seq", tiny_corpus)
    task.cfg = task.cfg.replace("data", val_bleu_sentences=30)
    whole = task.translation_scores(model)
    assert whole["chrf"] > 0  # the comparison is of real translations
    for scores in run_shards(3, lambda shard: task.translation_scores(model, shard)):
        assert scores == whole
