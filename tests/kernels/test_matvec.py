import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.errors import TformerError
from tformer.kernels import fp32, library
from tformer.kernels import int8 as kint8
from tformer.kernels.prepack import PackedLinear, prepack_available

native = pytest.mark.skipif(library.load() is None, reason="the kernel is not built here")


def reference(x, weight, bias):
    """The product in float64: a float32 kernel must sit within rounding of it."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 9])  # 7, 9: groups of four and the rest
@pytest.mark.parametrize(
    "n, k",
    [
        (1, 8),  # fewer rows of W than a block
        (11, 21),  # a remainder of rows of W and of the inner dimension
        (64, 7),  # an inner dimension shorter than one vector
        (768, 256),
        (1000, 1024),  # enough work for both threads
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_computes_the_linear_product(rows, n, k, bias):
    x, weight = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    got = fp32.matvec(x, weight, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight, b), atol=1e-4, rtol=1e-5)


@native
def test_the_kernel_keeps_the_leading_dimensions_and_reads_strided_inputs():
    weight, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(6, 2, 24)
    for view in (x[:2, 0], x[1:3].transpose(0, 1), x[::3]):
        assert not view.is_contiguous()
        got = fp32.matvec(view, weight, b)
        assert got.shape == (*view.shape[:-1], 40)
        torch.testing.assert_close(got.double(), reference(view, weight, b), atol=1e-4, rtol=1e-5)


@native
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it():
    # Batched and one-at-a-time decoding then agree exactly while the kernel serves both.
    weight, b = torch.randn(101, 300), torch.randn(101)
    x = torch.randn(10, 300)
    alone = torch.cat([fp32.matvec(x[i : i + 1], weight, b) for i in range(10)])
    for rows in (2, 3, 4, 5, 8, 10):
        assert torch.equal(fp32.matvec(x[:rows], weight, b), alone[:rows])
    assert torch.equal(fp32.matvec(x.flip(0), weight, b), alone.flip(0))


@native
@pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")
def test_a_packed_linear_sends_up_to_four_rows_through_the_kernel(monkeypatch):
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    assert packed.native
    calls = []
    real = fp32.matvec
    monkeypatch.setattr(fp32, "matvec", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        for shape in [(1, 32), (4, 32), (2, 2, 32), (5, 32), (3, 3, 32)]:
            x = torch.randn(shape)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    assert len(calls) == 3  # the 5- and 9-row products went to oneDNN


def test_without_a_compiler_decoding_keeps_to_the_library_kernels(
    monkeypatch, tmp_path, reload_kernel
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert library.load() is None
    if prepack_available():
        linear = nn.Linear(16, 8)
        packed = PackedLinear(linear)
        assert not packed.native
        x = torch.randn(1, 16)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_the_environment_can_turn_the_kernel_off(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert library.load() is None and kint8.isa() == "torch"


def test_the_environment_can_force_avx2(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_ISA", "avx2")
    assert kint8.isa() == ("avx2" if library.load() is not None else "torch")


def test_an_unknown_instruction_set_is_a_clear_error(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_ISA", "neon")
    with pytest.raises(TformerError,
                       match="TFORMER_ISA='neon': use one of avx512, avxvnni, avx2, torch"):
        library.load()


TORCH_ONLY = """
import torch
from tformer.decoding.beam import beam_search
from tformer.decoding.lm import generate
from tformer.kernels import int8 as kint8
from tformer.kernels.formats import quantize_model
from tformer.kernels.xent import cross_entropy
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig

assert kint8.isa() == "torch"
gpt = GPT(GPTConfig(vocab_size=31, context=16, n_layer=1, n_head=2, d_model=16, dropout=0.1))
tokens = torch.randint(0, 31, (2, 9))
logits = gpt(tokens[:, :-1])
cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=-1,
              label_smoothing=0.1).backward()
for weights in ("fp32", "int8"):
    list(generate(quantize_model(gpt.eval(), weights), tokens[:, :3], max_new_tokens=4))
cfg = Seq2SeqConfig(vocab_size=31, n_layer=1, n_head=2, d_model=16, d_ff=24, dropout=0.0)
translator = Seq2Seq(cfg).eval()
for weights in ("fp32", "int8"):
    beam_search(quantize_model(translator, weights), tokens, torch.ones_like(tokens, dtype=bool),
                beam=3, bos_id=1, eos_id=2, pad_id=0)
print("ran")
"""


def test_forced_to_torch_everything_runs_with_one_warning_line(tmp_path):
    # A fresh process, as a user's: training (dropout, the loss), generation and beam search
    # in fp32 and int8, every kernel's caller, and a single warning.
    env = {**os.environ, "TFORMER_ISA": "torch", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TORCH_ONLY], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    lines = done.stderr.strip().splitlines()
    assert lines == ["tformer's C kernels are not in use (TFORMER_ISA=torch): everything runs "
                     "on torch"], done.stderr


@native
@pytest.mark.slow  # a whole build; the next test runs the same steps with a stand-in compiler
def test_a_fresh_cache_builds_the_kernel_and_leaves_no_temporary_files(fresh_build):
    _, built = fresh_build  # load() in an empty cache, once a session
    assert len(built) == 1 and built[0].startswith("tformer-") and built[0].endswith(".so")


FAKE_CC = """#!/bin/sh
# a stand-in compiler: notes its arguments, writes its -o file, fails on a source named in FAIL
echo "$@" >> "$LOG"
out=""; prev=""
for a in "$@"; do
    if [ "$prev" = "-o" ]; then out="$a"; fi
    case "$a" in *"$FAIL"*) if [ -n "$FAIL" ]; then echo "$a: error: planted" >&2; exit 1; fi;; esac
    prev="$a"
done
echo built > "$out"
"""


@pytest.mark.parametrize("fail", ["", "kquants.c", "-shared"])
def test_a_build_compiles_each_source_links_them_and_leaves_nothing_else(tmp_path, monkeypatch,
                                                                         fail):
    """compile_library's steps with a stand-in compiler: every source to an object file of
    its own (-c, without -shared), one link of them all with the library's flags, the
    library renamed into place and nothing else left in its folder; a failing source or link
    is one error naming the command and the compiler's message, and leaves nothing at all."""
    cc, log, cache = tmp_path / "cc", tmp_path / "log", tmp_path / "cache"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    cache.mkdir()
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.setenv("FAIL", fail)
    target = cache / "tformer-test.so"
    if fail:
        with pytest.raises(library.Unavailable, match="planted") as raised:
            library.compile_library(str(cc), target)
        assert "\n" not in str(raised.value).split("failed: ")[0]
        assert list(cache.iterdir()) == []
        return
    library.compile_library(str(cc), target)
    assert [p.name for p in cache.iterdir()] == [target.name]
    calls = [line.split() for line in log.read_text().splitlines()]
    compiles, (link,) = calls[:-1], calls[-1:]
    assert sorted(c[c.index("-c") + 1] for c in compiles) == sorted(map(str, library.SOURCES))
    assert all("-shared" not in c for c in compiles)
    objects = [c[c.index("-o") + 1] for c in compiles]
    assert "-shared" in link and set(objects) <= set(link)


# --- inputs the kernel cannot read go to torch ------------------------------------------


def kernel_calls(monkeypatch) -> list[int]:
    fp32.available()  # its self-check calls the kernel too
    calls: list[int] = []
    real = fp32._call
    monkeypatch.setattr(fp32, "_call", lambda *a: calls.append(1) or real(*a))
    return calls


@native
@pytest.mark.parametrize(
    "case",
    ["float64 x", "bf16 x", "float64 bias", "transposed weight", "int8 weight", "meta device"],
)
def test_inputs_the_kernel_cannot_read_get_the_torch_product(monkeypatch, case):
    x, weight, bias = torch.randn(2, 24), torch.randn(16, 24), torch.randn(16)
    if case == "float64 x":
        x = x.double()
    elif case == "bf16 x":
        x = x.bfloat16()
    elif case == "float64 bias":
        bias = bias.double()
    elif case == "transposed weight":
        weight = torch.randn(24, 16).t()
    elif case == "int8 weight":  # int8 products go through linear_int8
        weight = torch.randint(-127, 128, (16, 24), dtype=torch.int8)
    elif case == "meta device":  # not the CPU, as a GPU would not be
        x, weight, bias = x.to("meta"), weight.to("meta"), bias.to("meta")
    calls = kernel_calls(monkeypatch)
    got = fp32.matvec(x, weight, bias)
    assert not calls, "the kernel must not read these"
    assert got.shape == (2, 16) and got.dtype == x.dtype and got.device == x.device
    if case == "meta device":
        return
    want = F.linear(x.double(), weight.double(), bias.double())
    tol = 5e-2 if x.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@native
def test_a_mismatched_inner_dimension_is_an_error_not_a_stray_read(monkeypatch):
    calls = kernel_calls(monkeypatch)
    with pytest.raises(RuntimeError):
        fp32.matvec(torch.randn(1, 20), torch.randn(16, 24), None)
    assert not calls


@native
def test_inputs_it_can_read_still_go_to_the_kernel(monkeypatch):
    calls = kernel_calls(monkeypatch)
    fp32.matvec(torch.randn(1, 24), torch.randn(16, 24), torch.randn(16))
    assert calls == [1]


# --- where the kernel is built and loaded from -------------------------------------------

PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void)
{
    FILE *f = fopen("%s", "w");
    if (f) fclose(f);
}
"""


def plant_library(path, marker, tmp_path):
    """A library whose constructor creates `marker`: loading it would show."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % marker)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)


@native
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_library_others_may_write_is_never_loaded(monkeypatch, tmp_path, reload_kernel,
                                                    copy_build):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    (cache / "tformer").mkdir(mode=0o700, parents=True)
    # Where load() looks for a build of these sources: a planted library stands there.
    built = cache / "tformer" / library.library_name(library.compiler())
    marker = tmp_path / "constructor-ran"

    # A group-writable library in the user's own cache: refused before loading.
    plant_library(built, marker, tmp_path)
    os.chmod(built, 0o775)
    library.load.cache_clear()
    assert library.load() is None
    assert not marker.exists()

    # A world-writable cache directory: the kernel is built privately, what lies there is
    # never read, and nothing of the private build is left behind.
    os.chmod(built, 0o755)
    os.chmod(cache / "tformer", 0o777)
    library.load.cache_clear()
    temporaries = set(Path(tempfile.gettempdir()).glob("tformer-kernel-*"))
    assert library.load() is not None
    assert not marker.exists()
    assert set(Path(tempfile.gettempdir()).glob("tformer-kernel-*")) == temporaries


def test_private_means_owned_by_this_user_and_writable_by_no_one_else(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir(mode=0o700)
    library.check_private(folder)
    for mode in (0o770, 0o707, 0o777):
        os.chmod(folder, mode)
        with pytest.raises(library.Unavailable, match="others may write"):
            library.check_private(folder)
    os.chmod(folder, 0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(library.Unavailable, match="not a plain directory"):
        library.check_private(link)
    built = folder / "x.so"
    built.write_bytes(b"")
    os.chmod(built, 0o755)
    library.check_private(built, directory=False)
    os.chmod(built, 0o757)
    with pytest.raises(library.Unavailable, match="others may write"):
        library.check_private(built, directory=False)


# --- a packed copy never goes stale ------------------------------------------------------


@pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")
def test_a_weight_update_is_seen_at_every_batch_size():
    linear = nn.Linear(32, 24)
    packed = PackedLinear(linear)
    x = torch.randn(9, 32)

    def check():
        with torch.no_grad():
            for rows in range(1, 10):
                want = reference(x[:rows], linear.weight, linear.bias)
                torch.testing.assert_close(packed(x[:rows]).double(), want, atol=1e-4,
                                           rtol=1e-4)

    check()
    with torch.no_grad():
        linear.weight.mul_(-3.0).add_(1.0)  # an in-place update, as an optimizer makes
    check()
    linear.load_state_dict({"weight": torch.randn(24, 32), "bias": torch.randn(24)})
    check()
    optimizer = torch.optim.SGD(linear.parameters(), lr=1.0)
    linear(torch.randn(3, 32)).square().sum().backward()
    optimizer.step()
    check()
