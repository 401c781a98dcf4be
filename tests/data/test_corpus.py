from pathlib import Path

import numpy as np
import pytest

from tformer.data import corpus
from tformer.data.corpus import cached_token_ids, read_corpus, read_text
from tformer.data.tokenizers import CharTokenizer, train_tokenizer
from tformer.errors import TformerError


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "is empty"),
        (b"  \n\n", "is empty"),
        (b"abc\x00def", "looks binary"),
        (b"caf\xe9 au lait", "not UTF-8 text .bad byte at offset 3"),
    ],
)
def test_bad_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(TformerError, match=message) as err:
        read_text(path)
    assert str(path) in str(err.value)


def test_missing_paths(tmp_path):
    with pytest.raises(TformerError, match="data path not found"):
        read_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TformerError, match="holds no files"):
        read_corpus(tmp_path / "empty")


def test_a_folder_is_its_files_in_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / ".hidden").write_text("never")
    assert read_corpus(tmp_path) == "first\nsecond"


def test_bom_is_dropped(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello".encode())
    assert read_text(path) == "hello"


def test_token_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    text = "hello world\n" * 10
    tok = CharTokenizer(text)
    ids = cached_token_ids(text, tok, cache=tmp_path)
    files = list(tmp_path.glob("tokens-*"))
    assert len(files) == 1
    assert isinstance(ids, np.memmap) and Path(ids.filename) == files[0].resolve()

    def no_encoding(*args, **kwargs):
        raise AssertionError("a cached text is not encoded again")

    monkeypatch.setattr(corpus, "encode_long_text", no_encoding)
    again = cached_token_ids(text, tok, cache=tmp_path)
    assert np.array_equal(ids, again) and list(tmp_path.glob("tokens-*")) == files
    assert tok.decode(ids.tolist()) == text


def test_bpe_corpus_encoding_round_trips(tmp_path):
    text = "line one\nline two\n\nthird line, longer than the others\n" * 30
    tok = train_tokenizer("bpe", text.splitlines(keepends=True), vocab_size=300)
    ids = cached_token_ids(text, tok, cache=tmp_path)
    assert tok.decode(ids.tolist()) == text


def test_unwritable_cache_still_works(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tok = CharTokenizer("ab")
    ids = cached_token_ids("abba", tok, cache=blocker / "sub")
    assert ids.tolist() == [0, 1, 1, 0]
