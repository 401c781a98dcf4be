import numpy as np
import pytest

from tformer.data.streams import TrainStreams, eval_streams
from tformer.data.tokenizers import IGNORE_INDEX
from tformer.errors import TformerError


def stream(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)


def test_each_row_continues_where_it_stopped():
    batches = TrainStreams(stream(1000), batch_size=4, segment_len=8, seed=0)
    first = next(batches)
    assert first.first and first.tokens.shape == (4, 8)
    previous = first
    for _ in range(5):
        batch = next(batches)
        assert not batch.first
        # Row b's next segment starts right after the last token of its previous segment.
        assert (batch.tokens[:, 0] == previous.tokens[:, -1] + 1).all()
        assert (batch.targets == batch.tokens + 1).all()
        previous = batch


def test_streams_are_disjoint_and_a_new_epoch_starts_over():
    batches = TrainStreams(stream(200), batch_size=3, segment_len=10, seed=0)
    # (200 - 1) // 3 = 66 tokens per stream: 6 segments, the tail of 6 left out.
    epoch = [next(batches) for _ in range(6)]
    seen = np.concatenate([b.tokens.numpy().ravel() for b in epoch])
    assert len(np.unique(seen)) == len(seen) == 180
    again = next(batches)
    assert again.first and batches.epoch == 1
    offset = int(again.tokens[0, 0])
    assert 0 <= offset < 10


def test_resume_continues_exactly():
    ids = stream(500)
    straight = TrainStreams(ids, batch_size=2, segment_len=7, seed=3)
    expected = [next(straight).tokens for _ in range(80)]
    first = TrainStreams(ids, batch_size=2, segment_len=7, seed=3)
    for _ in range(41):
        next(first)
    resumed = TrainStreams(ids, batch_size=2, segment_len=7, seed=3)
    resumed.load_state_dict(first.state_dict())
    for want in expected[41:]:
        assert (next(resumed).tokens == want).all()


def test_too_short_a_stream_is_a_clear_error():
    with pytest.raises(TformerError, match="too few for 8 streams"):
        TrainStreams(stream(50), batch_size=8, segment_len=8, seed=0)


@pytest.mark.parametrize(("n", "batch_size", "segment_len"), [(101, 4, 8), (50, 3, 7), (9, 12, 4)])
def test_evaluation_predicts_every_token_but_the_first_once(n, batch_size, segment_len):
    ids = stream(n)
    targets = []
    rows = None
    for i, batch in enumerate(eval_streams(ids, batch_size, segment_len)):
        assert batch.first == (i == 0)
        rows = rows or batch.tokens.shape[0]
        assert batch.tokens.shape[0] == rows
        real = batch.targets != IGNORE_INDEX
        assert (batch.targets[real] == batch.tokens[real] + 1).all()
        targets.append(batch.targets)
    # Rows are read in order: each row's targets, concatenated, are a contiguous run.
    per_row = [np.concatenate([t[b].numpy() for t in targets]) for b in range(rows)]
    per_row = [r[r != IGNORE_INDEX] for r in per_row]
    assert (np.concatenate(per_row) == np.arange(1, n)).all()
