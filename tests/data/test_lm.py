import numpy as np
import pytest
import torch

from tformer.data.lm import LMData, LMDataConfig, RandomWindows, sequential_windows
from tformer.errors import TformerError


def test_random_windows_are_shifted_pairs_and_resume_exactly():
    ids = np.arange(1000, dtype=np.uint16)
    batches = RandomWindows(ids, batch_size=4, context=8, seed=0)
    batch = next(batches)
    assert batch.tokens.shape == (4, 8)
    assert torch.equal(batch.targets, batch.tokens + 1)
    state = batches.state_dict()
    expected = [next(batches).tokens for _ in range(3)]
    resumed = RandomWindows(ids, batch_size=4, context=8, seed=123)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed).tokens, e) for e in expected)


def test_sequential_windows_predict_every_token_once():
    ids = np.arange(103, dtype=np.uint16)
    targets = torch.cat([b.targets.flatten() for b in sequential_windows(ids, 3, 10)])
    assert targets.tolist() == list(range(1, 103))


def test_split_is_the_tail(tiny_corpus):
    data = LMData(LMDataConfig(path=str(tiny_corpus), val_fraction=0.1))
    n = len(data.train_ids) + len(data.val_ids)
    assert len(data.val_ids) == int(n * 0.1)
    text = tiny_corpus.read_text()
    assert data.tokenizer.decode(data.val_ids.tolist()) == text[len(text) - len(data.val_ids):]


def test_too_little_data_is_explained():
    with pytest.raises(TformerError, match="fewer than context"):
        RandomWindows(np.arange(5, dtype=np.uint16), batch_size=2, context=8, seed=0)


def test_builtin_corpus_when_no_path():
    data = LMData(LMDataConfig(path=None, val_fraction=0.05))
    assert len(data.train_ids) > 100_000
    assert "def " in data.tokenizer.decode(data.train_ids[:20000].tolist())
