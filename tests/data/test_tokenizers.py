import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tformer.data.tokenizers import (
    BOS,
    EOS,
    PAD,
    BPEDropout,
    BPETokenizer,
    CharTokenizer,
    PretrainedBPETokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_from_json,
    train_tokenizer,
)
from tformer.errors import TformerError

SAMPLE = (
    "To be, or not to be: that is the question.\nSein oder Nichtsein — das ist hier die Frage.\n"
)


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe", [SAMPLE * 50], vocab_size=300)


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_char_round_trip_of_any_text(text):
    tok = CharTokenizer(text)
    assert tok.decode(tok.encode(text)) == text
    again = tokenizer_from_json(tok.to_json())
    assert again.encode(text) == tok.encode(text)


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_bpe_round_trip_of_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_bpe_dropout_of_zero_is_the_tokenizers_own_encoding(bpe, text):
    assert BPEDropout(bpe, 0.0).encode(text, random.Random(0)) == bpe.encode(text)


def test_bpe_dropout_gives_finer_segmentations_of_the_same_text(bpe):
    lines = SAMPLE.splitlines() * 20
    dropout = BPEDropout(bpe, 0.1)
    sampled = dropout.encode_batch(lines, random.Random(1))
    assert [bpe.decode(ids) for ids in sampled] == lines
    assert sum(map(len, sampled)) > sum(map(len, bpe.encode_batch(lines)))
    assert len({tuple(ids) for ids in sampled[:: len(SAMPLE.splitlines())]}) > 1
    assert dropout.encode_batch(lines, random.Random(1)) == sampled, "the seed decides"


def test_bpe_dropout_skips_each_merge_with_probability_p():
    """The word "abc", merges (a b) then (ab c): the first merge is skipped with probability
    p, which ends the loop (no other pair merges), and otherwise the second one is: so
    a|b|c, ab|c and abc come out with probabilities p, (1 - p) p and (1 - p)^2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, *alphabet, "ab", "abc"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = BPETokenizer(tok)
    assert bpe.encode("abc") == [vocab["abc"]]
    p, n = 0.3, 6000
    dropout, rng = BPEDropout(bpe, p), random.Random(2)
    counts = Counter(len(dropout.encode("abc", rng)) for _ in range(n))
    for pieces, expected in [(3, p), (2, (1 - p) * p), (1, (1 - p) ** 2)]:
        # Binomial standard deviations are below 0.0065 here: 0.03 is 4.6 of them.
        assert counts[pieces] / n == pytest.approx(expected, abs=0.03)


def test_char_tokenizer_names_unseen_characters():
    tok = CharTokenizer("abc")
    with pytest.raises(TformerError, match=r"never saw 2 of these characters: 'x', 'z'"):
        tok.encode("abxcz")


def test_special_tokens_come_first():
    tok = CharTokenizer("ba", specials=True)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("ab") == [3, 4]
    assert tok.decode([1, 3, 4, 2, 0]) == "ab"


def test_bpe_specials_and_save_load(bpe, tmp_path):
    assert [bpe.tok.id_to_token(i) for i in (bpe.pad_id, bpe.bos_id, bpe.eos_id)] == [PAD, BOS, EOS]
    assert bpe.vocab_size <= 300
    save_tokenizer(bpe, tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.kind == "bpe"
    assert loaded.encode(SAMPLE) == bpe.encode(SAMPLE)
    assert len(bpe.encode(SAMPLE)) < len(SAMPLE) / 2, "BPE merges common pieces"


def test_a_pretrained_tokenizer_keeps_every_eos_id_and_old_files_load(bpe, tmp_path):
    """Several end-of-text ids, eos_id first, saved and loaded; a file saved before they
    were kept (no eos_ids) loads with eos_id alone."""
    more = [bpe.tok.token_to_id(BOS), 7, bpe.tok.token_to_id(EOS)]
    tok = PretrainedBPETokenizer(bpe.tok, bos=BOS, eos=EOS, pad=PAD, more_eos=more)
    assert tok.eos_ids == (bpe.eos_id, bpe.bos_id, 7)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_ids == tok.eos_ids
    old = tokenizer_from_json(PretrainedBPETokenizer(bpe.tok, bos=BOS, eos=EOS).to_json())
    assert "eos_ids" not in old.to_json() and old.eos_ids == (bpe.eos_id,)
    with pytest.raises(TformerError, match="end-of-text id 300 is not a token"):
        PretrainedBPETokenizer(bpe.tok, bos=BOS, eos=EOS, more_eos=[300])


def test_a_chat_template_is_saved_and_loaded_beside_the_tokenizer(bpe, tmp_path):
    bpe.chat_template = "{{ messages[0]['content'] }}"
    try:
        save_tokenizer(bpe, tmp_path / "tokenizer.json")
    finally:
        bpe.chat_template = None
    assert (tmp_path / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert load_tokenizer(tmp_path / "tokenizer.json").chat_template == (
        "{{ messages[0]['content'] }}")
    (tmp_path / "plain").mkdir()
    save_tokenizer(bpe, tmp_path / "plain" / "tokenizer.json")
    assert load_tokenizer(tmp_path / "plain" / "tokenizer.json").chat_template is None
    assert not (tmp_path / "plain" / "chat_template.jinja").exists()


def test_unknown_kind_and_bad_file(tmp_path):
    with pytest.raises(TformerError, match="data.tokenizer = 'words'"):
        train_tokenizer("words", ["x"])
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TformerError, match="cannot read tokenizer"):
        load_tokenizer(bad)


def test_word_tokenizer_saves_and_loads(tmp_path):
    words = train_tokenizer("word", ["a b\nc\n"])
    save_tokenizer(words, tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.kind == "word" and loaded.encode("c a z\n") == words.encode("c a z\n")
    assert loaded.decode(loaded.encode("c a z\n")) == "c a <unk>\n"


@pytest.mark.parametrize("train, valid, vocab, n_train, n_valid", [
    ("ptb/ptb.train.txt", "ptb/ptb.valid.txt", 10000, 929589, 73760),
    ("wikitext-2/wiki.train.tokens", "wikitext-2/wiki.valid.tokens", 33278, 2088628, 217646),
])
def test_word_counts_match_the_published_ones(train, valid, vocab, n_train, n_valid):
    """The vocabulary and token counts of Merity et al. 2016 (Table 1: PTB 10k / 929k / 73k,
    WikiText-2 33,278 / 2,088,628 / 217,646), so perplexities compare with published ones."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # The configs' ../shared/data, from a checkout or from a worktree one level deeper.
    found = [d for d in (root.parent / "shared" / "data", root.parent.parent / "shared" / "data")
             if (d / train).exists()]
    if not found:
        pytest.skip("../shared/data is not here")
    data = found[0]
    text = (data / train).read_text(encoding="utf-8")
    words = train_tokenizer("word", [text])
    assert words.vocab_size == vocab
    assert len(words.encode(text)) == n_train
    assert len(words.encode((data / valid).read_text(encoding="utf-8"))) == n_valid
