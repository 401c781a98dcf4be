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
    with pytest.raises(TformerError, match="fewer than model.context"):
        RandomWindows(np.arange(5, dtype=np.uint16), batch_size=2, context=8, seed=0)


def test_builtin_corpus_when_no_path():
    data = LMData(LMDataConfig(path=None, val_fraction=0.05))
    assert len(data.train_ids) > 100_000
    assert "def " in data.tokenizer.decode(data.train_ids[:20000].tolist())


def test_a_validation_file_of_its_own(tmp_path, tiny_corpus):
    val = tmp_path / "valid.txt"
    val.write_text("Speak, speak.\nFirst Citizen:\n", encoding="utf-8")
    data = LMData(LMDataConfig(path=str(tiny_corpus), val_path=str(val), val_fraction=0.3))
    text = tiny_corpus.read_text()
    assert data.tokenizer.decode(data.train_ids.tolist()) == text  # all of path trains
    assert data.tokenizer.decode(data.val_ids.tolist()) == val.read_text()


def test_no_validation_split_names_its_cause(tiny_corpus):
    with pytest.raises(TformerError, match=r"validation split has 0 tokens \(data.val_fraction "
                       r"= 0 of .*data.val_path"):
        LMData(LMDataConfig(path=str(tiny_corpus), val_fraction=0.0))


def test_words_and_line_ends_are_the_tokens(tmp_path):
    """The word-level corpora's convention (PTB, WikiText): one token per white-space word
    and one per line end; validation words the training text lacks are <unk>."""
    train, val = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("the cat sat\n\nthe  dog ran\n", encoding="utf-8")
    val.write_text("the bird sat\n", encoding="utf-8")
    data = LMData(LMDataConfig(path=str(train), val_path=str(val), tokenizer="word"))
    tok = data.tokenizer
    assert tok.vocab_size == 2 + 5  # <unk>, line end, and the five words
    assert len(data.train_ids) == 3 + 1 + 1 + 3 + 1
    assert tok.decode(data.train_ids.tolist()) == "the cat sat\n\nthe dog ran\n"
    assert tok.decode(data.val_ids.tolist()) == "the <unk> sat\n"
