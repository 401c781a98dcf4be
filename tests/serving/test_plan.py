"""serving/plan.py's plan_step on requests written as numbers: no model, no tensor."""

from __future__ import annotations

from tformer.serving.plan import DECODING_SHARE, MIN_PIECE, Phase, PoolView, Want, plan_step

BS = 16


def pool(free: int, context: int = 4096) -> PoolView:
    return PoolView(free=free, block_size=BS, context=context)


def decoding(key: int, length: int, **kw) -> Want:
    """A row that holds `length` positions, in as many blocks as they fill."""
    return Want(key, Phase.DECODING, length, length, -(-length // BS), order=key, **kw)


def reading(key: int, done: int, text: int, **kw) -> Want:
    return Want(key, Phase.READING, done, text, -(-done // BS), order=key, **kw)


def waiting(key: int, text: int, **kw) -> Want:
    kw.setdefault("order", key)
    return Want(key, Phase.WAITING, 0, text, **kw)


def test_the_budget_holds_decoding_and_reading_together():
    """Eight rows decode; a 1,000-token prompt is read a sixteenth of the budget at a time
    (less the rows' tokens, MIN_PIECE at least), and a 20-token one is read whole beside it."""
    wants = [decoding(i, 40) for i in range(8)] + [reading(8, 0, 1000), waiting(9, 20)]
    plan = plan_step(wants, pool(1000), 1024, max_batch=16)
    assert plan.decode == list(range(8)) and plan.admit == [9]
    assert dict(plan.chunks) == {9: 20, 8: 1024 // DECODING_SHARE - 8}
    assert plan.tokens <= 1024
    plan = plan_step(wants, pool(1000), 128, max_batch=16)
    assert dict(plan.chunks) == {9: 20, 8: MIN_PIECE}
    # With no row decoding, a long prompt takes the whole budget.
    plan = plan_step([reading(8, 0, 1000)], pool(1000), 128, max_batch=16)
    assert plan.chunks == [(8, 128)]


def test_a_short_prompt_arriving_while_a_long_one_is_read_is_read_at_once():
    """A 7,000-token prompt is being read in chunks with the whole budget; seven short
    prompts arrive: all are admitted and read whole in the next step (their first token
    comes from it), and the long one takes what they leave."""
    long = reading(0, 512, 7000)
    shorts = [waiting(i, 30 + i) for i in range(1, 8)]
    plan = plan_step([long, *shorts], pool(1000), 512, max_batch=16)
    assert sorted(plan.admit) == list(range(1, 8))
    read = dict(plan.chunks)
    assert all(read[i] == 30 + i for i in range(1, 8))
    assert read[0] == 512 - sum(30 + i for i in range(1, 8))
    assert plan.tokens == 512


def test_lower_priority_values_are_admitted_first_and_preempted_ones_before_new():
    wants = [waiting(1, 10), waiting(2, 10, priority=-1), waiting(3, 10, priority=5),
             waiting(4, 10, resumed=True, order=9)]
    assert plan_step(wants, pool(100), 512, max_batch=2).admit == [2, 4]
    assert plan_step(wants, pool(100), 512, max_batch=3).admit == [2, 4, 1]


def test_rows_that_need_blocks_preempt_texts_being_read_before_rows_that_decode():
    """Two rows at a block's end need a block each; the pool has none. A partly read text's
    blocks go first (the one with most left), and only then the row that came last."""
    rows = [decoding(0, 32), decoding(1, 32)]
    texts = [reading(2, 16, 100), reading(3, 16, 50)]
    plan = plan_step(rows + texts, pool(0), 512, max_batch=8)
    assert [key for key, _ in plan.preempt] == [2, 3]
    assert plan.decode == [0, 1] and not plan.fail
    # No text to take from: the last row to arrive gives its blocks back.
    plan = plan_step(rows, pool(0), 512, max_batch=8)
    assert [key for key, _ in plan.preempt] == [1] and plan.decode == [0]
    # A lower priority (larger value) row goes first, whatever its arrival.
    rows = [decoding(0, 32, priority=3), decoding(1, 32)]
    plan = plan_step(rows, pool(0), 512, max_batch=8)
    assert [key for key, _ in plan.preempt] == [0] and plan.decode == [1]


def test_a_row_that_cannot_step_even_alone_fails_and_speculation_counts_its_drafts():
    plan = plan_step([decoding(0, 32)], pool(0), 512, max_batch=8)
    assert [key for key, _ in plan.fail] == [0] and not plan.decode
    # A speculative round of 4 drafts needs room for 5 positions: 30 + 5 > 32.
    rows = [decoding(0, 30), decoding(1, 30)]
    assert plan_step(rows, pool(0), 512, max_batch=8).decode == [0, 1]
    plan = plan_step(rows, pool(0), 512, max_batch=8, ahead=5)
    assert [key for key, _ in plan.preempt] == [1] and plan.decode == [0]


def test_a_chunk_is_cut_to_the_free_blocks_and_a_text_with_more_left_gives_way():
    # Two free blocks: 32 positions of a 100-token text.
    plan = plan_step([reading(0, 0, 100)], pool(2), 512, max_batch=8)
    assert plan.chunks == [(0, 32)]
    # No block free: the text with more left to read gives its blocks to the one with less.
    plan = plan_step([reading(0, 32, 40), reading(1, 32, 400)], pool(0), 512, max_batch=8)
    assert plan.preempt == [(1, "a text with less left to read needs its blocks")]
    assert plan.chunks == [(0, 8)]
    # A text that cannot fit in the whole pool, with nothing else in it, fails.
    plan = plan_step([reading(0, 0, 100)], pool(3), 512, max_batch=8)
    assert plan.chunks == [(0, 48)]
    plan = plan_step([reading(0, 48, 100)], pool(0), 512, max_batch=8)
    assert [key for key, _ in plan.fail] == [0]


def test_a_steady_stream_of_long_prompts_does_not_starve_the_first():
    """A 2,000-token prompt, then every step a new 600-token one, while rows decode: texts
    too long for the step are read in order of arrival (not the least left first, which
    would read every newcomer before the first one's 1,940 left), so each is read to its
    end in turn, and every step the rows decode."""
    budget, rows = 256, [decoding(100 + i, 40) for i in range(4)]
    texts: dict[int, list[int]] = {}  # key -> [done, length]
    finished = []
    for step in range(400):
        texts[step] = [0, 2000 if step == 0 else 600]
        wants = rows + [reading(key, done, n) for key, (done, n) in texts.items()]
        plan = plan_step(wants, pool(10**6), budget, max_batch=10**6)
        assert plan.decode == [w.key for w in rows] and plan.tokens <= budget
        for key, n in plan.chunks:
            texts[key][0] += n
            if texts[key][0] == texts[key][1]:
                finished.append(key)
                del texts[key]
    assert finished == sorted(finished) and len(finished) >= 10
    assert finished[:3] == [0, 1, 2]


def test_the_n_choices_of_a_prompt_read_one_first_and_the_others_take_its_blocks():
    wants = [waiting(0, 40, start=7), waiting(1, 40, start=7), waiting(2, 40, start=8)]
    plan = plan_step(wants, pool(100), 512, max_batch=8)
    assert plan.admit == [0, 1, 2] and dict(plan.chunks) == {0: 40, 2: 40}
