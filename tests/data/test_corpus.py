import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tformer.data import corpus
from tformer.data.corpus import (
    cached_token_ids,
    check_utf8,
    corpus_chunks,
    corpus_token_ids,
    decode_utf8,
    encode_long_text,
    read_corpus,
    read_text,
    text_files,
)
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


CORPUS_FILES = [
    "line one\r\nline two\n\n\u00e9t\u00e9 \u2028 \ufeffmid\n",
    "\ufeffsecond file, no newline at its end",
    "third\u3000file\n\n" * 7,
]


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 64, 1 << 22])
@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_corpus_read_in_pieces_gives_the_ids_of_the_whole_text(
    tmp_path, monkeypatch, chunk_bytes, kind
):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, text in enumerate(CORPUS_FILES):
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    whole = read_corpus(folder)
    tok = train_tokenizer(kind, whole.splitlines(keepends=True), vocab_size=300)
    expected = encode_long_text(whole, tok)
    monkeypatch.setattr(corpus, "CHUNK_BYTES", chunk_bytes)
    pieces = list(corpus_chunks(text_files(folder)))
    assert "".join(pieces) == whole
    assert all(p.endswith("\n") for p in pieces[:-1])
    ids = corpus_token_ids(folder, tok, cache=tmp_path / "cache")
    assert ids.tolist() == expected
    # Read whole or in pieces, the same text finds the same cache entry.
    assert cached_token_ids(whole, tok, cache=tmp_path / "cache").tolist() == expected
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.parametrize(
    "content",
    [b"ok\n" * 50 + b"\xff", b"ab\xc3", b"\xef\xbb\xbfab\xe9cd", b"   \n", b"x\x00y"],
)
def test_a_corpus_read_in_pieces_fails_as_a_whole_read_does(tmp_path, monkeypatch, content):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(TformerError) as whole:
        read_text(path)
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 2)
    with pytest.raises(TformerError) as pieces:
        list(corpus_chunks([path]))
    assert str(pieces.value) == str(whole.value)


def test_tokenizing_holds_the_same_memory_for_a_file_four_times_larger(tmp_path, monkeypatch):
    """Read in 64 KiB pieces, the Python heap's peak does not grow with the file (a whole
    read would hold the text, its UTF-8 copy for hashing, and a list of the ids)."""
    line = "the quick brown fox jumps over the lazy dog, again and again\n"
    tok = CharTokenizer(line)
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 1 << 16)
    peaks = []
    for mib in (2, 8):
        path = tmp_path / f"{mib}.txt"
        with open(path, "w") as f:
            f.write(line * (mib * 2**20 // len(line)))
        tracemalloc.start()
        try:
            ids = corpus_token_ids(path, tok, cache=tmp_path / "cache")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(ids) == path.stat().st_size
        assert tok.decode(ids[-len(line) :].tolist()) == line
        peaks.append(peak)
    assert peaks[1] < 1.5 * peaks[0] and peaks[1] < 2**20 * 8 / 4, peaks


def test_text_from_outside_must_be_utf8():
    with pytest.raises(TformerError, match=r"standard input is not UTF-8 text \(byte 0xff"):
        decode_utf8(b"ok\n\xff", "standard input")
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # as argv arrives from Latin-1
    with pytest.raises(TformerError, match=r"--prompt is not UTF-8 text \(byte 0xe9"):
        check_utf8(prompt, "--prompt")
    assert check_utf8("caf\u00e9", "--prompt") == "caf\u00e9"
