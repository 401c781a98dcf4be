"""Building the kernels' C library: where it is compiled, with which flags, and which
instruction set the process asks for.

The C sources ship with the package and are compiled on first use with the system's C
compiler (`$CC`, else `cc`), into `$XDG_CACHE_HOME/tformer` (`~/.cache/tformer`), keyed by
a hash of the sources and the command. Loading a library runs its constructors before any
check can, so the kernel is built and loaded only from a directory that this user owns and
nobody else may write to, and only a library file with the same properties; where the
cache directory fails that test, a private temporary directory serves this process (and is
removed once the library is loaded). Where none of this can happen (no compiler, not x86-64
Linux with AVX2 and FMA, `TFORMER_ISA=torch` in the environment) `load()` returns None, with
one warning: fp32 decoding keeps to oneDNN, with the same results up to float rounding, and
int8 to torch's integer product, with the same results bit for bit, dropout to torch's
(with other masks) and the loss to F.cross_entropy.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from tformer.errors import TformerError

log = logging.getLogger(__name__)

ISAS = ("avx512", "avxvnni", "avx2", "torch")
"""TFORMER_ISA's values (see matvec.py's text)."""
ISA_NAMES = {"avx512": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2", "torch": "torch"}
"""How tables name them."""
SOURCES = [Path(__file__).with_name(name)
           for name in ("matvec.c", "search.c", "attend.c", "step.c", "dropout.c", "xent.c",
                        "glu.c", "rmsnorm.c", "blocks.c")]
"""Built into one library: the products, beam search's candidates (search.py), a decoding
step's attention (attend.py) and whole decoder layer (step.py), and for training, dropout
(dropout.py), the cross-entropy (xent.py), SwiGLU's gate (glu.py) and RMSNorm (rmsnorm.py);
and the products over block-quantized weights (blocks.py)."""
HEADERS = [Path(__file__).with_name(name) for name in ("vecmath.h", "int8_bytes.h", "blocks_isa.h")]
"""Included by the sources: part of the key the built library is cached under."""
PRIVATE_PREFIX = "tformer-kernel-"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]



class Unavailable(Exception):
    """The library cannot be built or loaded here; the message says why."""


def requested_isa() -> str | None:
    """TFORMER_ISA's value (TFORMER_NATIVE=0: "torch"), or None where it is not set."""
    if os.environ.get("TFORMER_NATIVE", "1") == "0":
        return "torch"
    want = os.environ.get("TFORMER_ISA", "").strip().lower() or None
    if want is not None and want not in ISAS:
        raise TformerError(f"TFORMER_ISA={want!r}: use one of {', '.join(ISAS)}")
    return want


def compiler() -> str | None:
    """The C compiler the kernels are built with: `$CC`, else `cc`, else `gcc`; None where
    there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "tformer"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(path)
        return path
    except (OSError, Unavailable) as e:
        log.info("not building the kernel in %s (%s): using a private temporary directory",
                 path, e)
    # mkdtemp makes a new directory only this user can enter, under a name nobody can guess.
    return Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))


def check_private(path: Path, *, directory: bool = True) -> None:
    """Raise Unavailable unless `path` is a real directory (or file) owned by this user that
    neither its group nor others may write."""
    info = os.lstat(path)
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(info.st_mode):
        raise Unavailable(f"{path} is not a plain {'directory' if directory else 'file'}")
    if info.st_uid != os.geteuid():
        raise Unavailable(f"{path} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unavailable(f"others may write to {path}")


def compile_library(compiler: str, library: Path) -> None:
    # Build under a temporary name and rename: a process that finds the library finds all
    # of it, even while another one is compiling.
    fd, tmp = tempfile.mkstemp(dir=library.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)  # whatever the umask: nobody else may write it
        os.replace(tmp, library)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"{' '.join(cmd)} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


