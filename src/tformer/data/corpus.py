"""Reading text corpora safely and caching their token ids.

A corpus is a UTF-8 text file or a folder of them. Its token ids are computed once and kept
as a flat numpy file in a cache directory (never beside the data, which may be read-only),
keyed by a hash of the text and the tokenizer, then memory-mapped.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import suppress
from pathlib import Path

import numpy as np

from tformer.data.tokenizers import Tokenizer
from tformer.errors import TformerError

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """$TFORMER_CACHE, else $XDG_CACHE_HOME/tformer, else ~/.cache/tformer."""
    if os.environ.get("TFORMER_CACHE"):
        return Path(os.environ["TFORMER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tformer"


def text_files(path: str | Path) -> list[Path]:
    """The files of a corpus: the file itself, or every non-hidden file under a folder."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise TformerError(f"data folder {path} holds no files")
        return files
    raise TformerError(f"data path not found: {path}")


def read_text(path: str | Path) -> str:
    """A file's text, with a one-line error for a file that is empty, binary or not UTF-8."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TformerError(f"data file not found: {path}") from None
    except OSError as e:
        raise TformerError(f"cannot read data file {path}: {e.strerror}") from None
    if not raw.strip():
        raise TformerError(f"data file {path} is empty")
    if b"\x00" in raw[:65536]:
        raise TformerError(f"data file {path} looks binary (it contains NUL bytes), not text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TformerError(
            f"data file {path} is not UTF-8 text (bad byte at offset {e.start})"
        ) from None
    return text.removeprefix("\ufeff")


def decode_utf8(raw: bytes, what: str) -> str:
    """Bytes as text, or a one-line error naming `what` and the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TformerError(
            f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None


def check_utf8(text: str, what: str) -> str:
    """Text that came in through the OS (arguments, environment), which Python decodes
    with surrogate escapes: reject bytes that were not UTF-8, naming the first one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = text[e.start].encode("utf-8", "surrogateescape")[0]
        raise TformerError(
            f"{what} is not UTF-8 text (byte 0x{byte:02x} at character {e.start})"
        ) from None
    return text


def read_corpus(path: str | Path) -> str:
    """All text of a file or a folder of files, joined by newlines in sorted order."""
    return "\n".join(read_text(p) for p in text_files(path))


CHUNK_BYTES = 1 << 22
"""How much of a data file is read, decoded and tokenized at a time (4 MiB)."""


def corpus_chunks(files: Sequence[Path]) -> Iterator[str]:
    """The text `read_corpus` gives, in pieces that each end at a line end (but the last):
    a file larger than memory is read, checked and tokenized a piece at a time."""
    carry = ""
    for i, path in enumerate(files):
        pieces = _file_pieces(path)
        if i:
            carry += "\n"
        for piece in pieces:
            piece = carry + piece
            cut = piece.rfind("\n") + 1
            if cut:
                yield piece[:cut]
            carry = piece[cut:]
    if carry:
        yield carry


def _file_pieces(path: Path) -> Iterator[str]:
    """A file's text in pieces of about CHUNK_BYTES, with read_text's checks."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    offset, seen_text = 0, False
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(CHUNK_BYTES)
                if offset == 0 and b"\x00" in raw[:65536]:
                    raise TformerError(
                        f"data file {path} looks binary (it contains NUL bytes), not text"
                    )
                pending = len(decoder.getstate()[0])  # bytes of a character cut in two
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise TformerError(
                        f"data file {path} is not UTF-8 text (bad byte at offset "
                        f"{offset - pending + e.start})"
                    ) from None
                seen_text = seen_text or bool(raw.strip())
                offset += len(raw)
                if text:
                    yield text
                if not raw:
                    break
    except FileNotFoundError:
        raise TformerError(f"data file not found: {path}") from None
    except OSError as e:
        raise TformerError(f"cannot read data file {path}: {e.strerror}") from None
    if not seen_text:
        raise TformerError(f"data file {path} is empty")


def corpus_token_ids(
    path: str | Path, tokenizer: Tokenizer, *, cache: Path | None = None
) -> np.ndarray:
    """Token ids of a file or folder (as `read_corpus` reads it), memory-mapped from the
    cache; the text is never held whole, so a corpus larger than memory works."""
    files = text_files(path)
    return token_ids(lambda: corpus_chunks(files), tokenizer, cache=cache)


def cached_token_ids(
    text: str, tokenizer: Tokenizer, *, cache: Path | None = None
) -> np.ndarray:
    """Token ids of `text`, memory-mapped from the cache (computed and stored on a miss)."""
    return token_ids(lambda: [text], tokenizer, cache=cache)


def token_ids(
    chunks: Callable[[], Iterable[str]], tokenizer: Tokenizer, *, cache: Path | None = None
) -> np.ndarray:
    """Token ids of the text `chunks()` yields (pieces ending at line ends), memory-mapped
    from the cache. On a miss they are encoded a piece at a time into the cache file.

    The key hashes the tokenizer and the text's UTF-8 bytes, so a text cached whole and the
    same text read in pieces share one entry.
    """
    cache = cache or cache_dir()
    key = hashlib.sha256()
    key.update(tokenizer.to_json().encode())
    key.update(b"\x00")
    for chunk in chunks():
        key.update(chunk.encode("utf-8", "surrogatepass"))
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    path = cache / f"tokens-{key.hexdigest()[:32]}.{dtype.name}"
    if path.exists():
        return np.load(path, mmap_mode="r")

    def encoded() -> Iterator[np.ndarray]:
        for chunk in chunks():
            yield np.asarray(encode_long_text(chunk, tokenizer), dtype=dtype)

    raw = path.with_name(f".{path.name}.{os.getpid()}.raw")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        n = 0
        with open(raw, "wb") as f:
            for ids in encoded():
                ids.tofile(f)
                n += len(ids)
        # .npy with a header, copied over in slices: np.load can memory-map it.
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
        if n:
            src = np.memmap(raw, dtype=dtype, mode="r", shape=(n,))
            for start in range(0, n, CHUNK_BYTES):
                out[start : start + CHUNK_BYTES] = src[start : start + CHUNK_BYTES]
            del src
        out.flush()
        del out
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the token cache in %s (%s); going on without it", cache, e)
        return np.concatenate([np.zeros(0, dtype), *encoded()])
    finally:
        for leftover in (raw, tmp):
            with suppress(OSError):
                leftover.unlink(missing_ok=True)
    return np.load(path, mmap_mode="r")


def encode_long_text(text: str, tokenizer: Tokenizer, chunk_lines: int = 4096) -> list[int]:
    """Encode a large text in batches of lines (so BPE runs in parallel); line ends are kept,
    so decoding the ids gives the text back."""
    if tokenizer.kind == "char":
        return tokenizer.encode(text)
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    for start in range(0, len(lines), chunk_lines):
        for line_ids in tokenizer.encode_batch(lines[start : start + chunk_lines]):
            ids.extend(line_ids)
    return ids
