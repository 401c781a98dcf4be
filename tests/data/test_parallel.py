import dataclasses

import numpy as np
import pytest
import torch

from tformer.config import config_from_dict
from tformer.data.builtin import german_number, number_pairs
from tformer.data.parallel import (
    IGNORE_INDEX,
    ParallelData,
    ParallelDataConfig,
    TokenBatches,
    batch_by_tokens,
    encode_source,
    make_batch,
    pad_right,
    read_pairs,
)
from tformer.data.tokenizers import train_tokenizer
from tformer.errors import TformerError


@pytest.fixture
def tokenizer():
    return train_tokenizer("char", ["abcdefgh"], specials=True)


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_files_with_different_line_counts_are_a_clear_error(tmp_path):
    src = write(tmp_path / "a.en", ["one", "two", "three"])
    tgt = write(tmp_path / "a.de", ["eins", "zwei"])
    with pytest.raises(TformerError, match=r"a\.en has 3 lines, .*a\.de has 2"):
        read_pairs(src, tgt)


def test_lines_split_on_newlines_only(tmp_path):
    src = write(tmp_path / "a.en", ["form\x0cfeed", "line\u2028separator"])
    tgt = write(tmp_path / "a.de", ["x", "y"])
    assert read_pairs(src, tgt) == (["form\x0cfeed", "line\u2028separator"], ["x", "y"])


def test_a_missing_or_binary_file_is_a_clear_error(tmp_path):
    with pytest.raises(TformerError, match="not found"):
        read_pairs(tmp_path / "nope.en", tmp_path / "nope.de")
    (tmp_path / "bin.en").write_bytes(b"\x00\x01\x02")
    write(tmp_path / "ok.de", ["x"])
    with pytest.raises(TformerError, match="binary"):
        read_pairs(tmp_path / "bin.en", tmp_path / "ok.de")


def test_half_a_pair_of_files_is_a_config_error():
    with pytest.raises(TformerError, match="data.train_src is set but data.train_tgt is not"):
        ParallelDataConfig(train_src="a.en")


def test_make_batch_adds_bos_and_eos_and_ignores_padding(tokenizer):
    src = [[5, 6, 2], [7, 2]]
    tgt = [[8, 2], [9, 10, 11, 2]]
    batch = make_batch(src, tgt, tokenizer)
    assert batch.src.tolist() == [[5, 6, 2], [7, 2, 0]]
    assert batch.src_real.tolist() == [[True, True, True], [True, True, False]]
    assert batch.tgt_in.tolist() == [[1, 8, 0, 0], [1, 9, 10, 11]]
    assert batch.tgt_out.tolist() == [[8, 2, IGNORE_INDEX, IGNORE_INDEX], [9, 10, 11, 2]]
    assert batch.num_tokens == 6


@pytest.mark.parametrize("lengths", [[1], [3, 0, 5], [7, 7], list(range(40, 0, -3))])
def test_pad_right_matches_padding_row_by_row(lengths):
    rng = np.random.default_rng(len(lengths))
    sequences = [rng.integers(3, 1000, n).tolist() for n in lengths]
    ids, is_real = pad_right(sequences, 0)
    width = max(lengths)
    assert ids.tolist() == [s + [0] * (width - len(s)) for s in sequences]
    assert is_real.tolist() == [[j < len(s) for j in range(width)] for s in sequences]
    assert ids.dtype == torch.long and is_real.dtype == torch.bool


def test_batches_stay_within_max_tokens():
    rng = np.random.default_rng(0)
    cost = rng.integers(1, 40, size=500)
    order = np.argsort(cost, kind="stable")
    batches = batch_by_tokens(order, cost, max_tokens=100)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    for b in batches:
        assert len(b) == 1 or len(b) * cost[b].max() <= 100


def make_batches(seed=0, n=200):
    rng = np.random.default_rng(1)
    src = [[3] * int(k) + [2] for k in rng.integers(1, 30, size=n)]
    tgt = [[4] * int(k) + [2] for k in rng.integers(1, 30, size=n)]
    tok = train_tokenizer("char", ["ab"], specials=True)
    return TokenBatches(src, tgt, tok, max_tokens=120, seed=seed), src


def test_an_epoch_covers_every_pair_once_and_the_next_epoch_is_reshuffled():
    batches, src = make_batches()
    seen = []
    first = []
    for _ in range(len(batches)):
        batch = next(batches)
        first.append(batch.src.shape)
        assert batch.src.numel() <= 120 or batch.src.shape[0] == 1
        seen.append(int(batch.src_real.sum()))
    assert sum(seen) == sum(len(s) for s in src)
    second = [next(batches).src.shape for _ in range(len(first))]
    assert batches.epoch == 1 and first != second


def test_resuming_from_the_state_gives_the_same_batches():
    batches, _ = make_batches()
    for _ in range(len(batches) + 3):  # into the second epoch
        next(batches)
    state = batches.state_dict()
    expected = [next(batches) for _ in range(5)]
    resumed, _ = make_batches()
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.src, want.src) and torch.equal(got.tgt_out, want.tgt_out)


@pytest.fixture
def dropout_data(tmp_path):
    words = "a man in a blue shirt is playing the guitar on a street near two dogs".split()
    rng = np.random.default_rng(3)
    src = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(300)]
    tgt = [s.upper() for s in src]
    cfg = ParallelDataConfig(
        train_src=str(write(tmp_path / "t.en", src)), train_tgt=str(write(tmp_path / "t.de", tgt)),
        val_fraction=0.1, vocab_size=320, bpe_dropout=0.2, max_len=40, max_tokens=300,
    )
    return ParallelData(cfg)


def test_bpe_dropout_segments_the_training_pairs_afresh_each_epoch(dropout_data):
    data = dropout_data
    first, again, second = data.resegment(0, 0), data.resegment(0, 0), data.resegment(0, 1)
    assert first == again and first != second and first != data.resegment(1, 0)
    for src, tgt in (first, second):
        assert [data.tokenizer.decode(ids) for ids in src] == data.train_text[0]
        assert [data.tokenizer.decode(ids) for ids in tgt] == data.train_text[1]
        assert all(ids[-1] == data.tokenizer.eos_id for ids in src + tgt)
        assert sum(map(len, src)) > sum(map(len, data.train_src))
        # Longer than max_len: the sentence keeps its one deterministic segmentation.
        assert max(map(len, src + tgt)) <= data.cfg.max_len
    # Validation is never resegmented.
    assert data.val_src == encode_source(data.tokenizer, data.val_text[0])


def test_bpe_dropout_of_the_source_alone_keeps_the_targets(dropout_data):
    data = dropout_data
    data.cfg = dataclasses.replace(data.cfg, bpe_dropout_sides="source")
    src, tgt = data.resegment(0, 0)
    assert tgt == data.train_tgt and src == data.resegment(0, 0)[0] != data.train_src


def test_bpe_dropout_sentences_past_max_len_keep_their_segmentation(dropout_data):
    data = dropout_data
    fixed = max(len(ids) for ids in data.train_tgt)
    data.cfg = dataclasses.replace(data.cfg, max_len=fixed)
    _, tgt = data.resegment(0, 0)
    kept = [t for t, f in zip(tgt, data.train_tgt, strict=True) if t == f]
    assert max(map(len, tgt)) <= fixed
    assert any(len(t) == fixed for t in kept), "the longest would have grown"


def test_resuming_mid_epoch_with_bpe_dropout_gives_the_same_batches(dropout_data):
    data = dropout_data

    def batches():
        return TokenBatches(data.train_src, data.train_tgt, data.tokenizer, max_tokens=300,
                            seed=5, resegment=data.resegment)

    run = batches()
    first_epoch = [next(run) for _ in range(len(run))]
    assert sum(b.num_tokens for b in first_epoch) == sum(map(len, data.resegment(5, 0)[1]))
    for _ in range(3):
        next(run)
    state = run.state_dict()
    expected = [next(run) for _ in range(4)]
    resumed = batches()
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.src, want.src) and torch.equal(got.tgt_out, want.tgt_out)


def test_bpe_dropout_needs_a_bpe_tokenizer(tmp_path):
    with pytest.raises(TformerError, match='data.bpe_dropout = 0.1 needs data.tokenizer = "bpe"'):
        ParallelDataConfig(tokenizer="char", bpe_dropout=0.1)
    with pytest.raises(TformerError, match="data.bpe_dropout = 1.0 must be at most 0.99"):
        ParallelDataConfig(bpe_dropout=1.0)
    with pytest.raises(TformerError, match="data.bpe_dropout_sides = 'target'"):
        ParallelDataConfig(bpe_dropout=0.1, bpe_dropout_sides="target")


def test_filtering_by_length_and_ratio(tmp_path):
    src = write(tmp_path / "t.en", ["ab", "abababababab", "a", "abc"])
    tgt = write(tmp_path / "t.de", ["ba", "b", "ab", "ab" * 40])
    cfg = ParallelDataConfig(
        train_src=str(src), train_tgt=str(tgt), val_src=str(src), val_tgt=str(tgt),
        tokenizer="char", max_len=20, max_ratio=2.0,
    )
    data = ParallelData(cfg)
    # Kept: "ab"/"ba" (3 and 3 tokens) and "a"/"ab" (2 and 3). Left out: ratio 13/2, and a
    # target of 81 tokens.
    assert len(data.train_src) == 2
    # Validation keeps odd ratios and leaves out only what is too long.
    assert len(data.val_src) == 3


def test_builtin_task_is_generated_with_one_right_answer():
    assert german_number(347) == "dreihundertsiebenundvierzig"
    assert german_number(101_021) == "einhunderteintausendeinundzwanzig"
    assert german_number(16) == "sechzehn" and german_number(70) == "siebzig"
    pairs = number_pairs(100, 999)
    assert len({s for s, _ in pairs}) == 100
    assert all(german_number(int(s)) == t for s, t in pairs)
    assert number_pairs(2000, 999)[0] == number_pairs(2000, 999)[0]


def test_a_seq2seq_config_with_no_data_uses_the_builtin_task():
    cfg = config_from_dict({"model": {"family": "seq2seq"},
                            "data": {"tokenizer": "char", "builtin_pairs": 300,
                                     "builtin_max": 999, "max_ratio": 12.0}})
    data = ParallelData(cfg.data)
    assert len(data.train_src) + len(data.val_src) == 300
    assert data.tokenizer.decode(data.val_src[0])[0].isdigit()
