import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.kernels import matvec
from tformer.kernels.prepack import PackedLinear, prepack_available

native = pytest.mark.skipif(matvec.load() is None, reason="the kernel is not built here")


def reference(x, weight, bias):
    """The product in float64: a float32 kernel must sit within rounding of it."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
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
    got = matvec.matvec(x, weight, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(x, weight, b), atol=1e-4, rtol=1e-5)


@native
def test_the_kernel_keeps_the_leading_dimensions_and_reads_strided_inputs():
    weight, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(6, 2, 24)
    for view in (x[:2, 0], x[1:3].transpose(0, 1), x[::3]):
        assert not view.is_contiguous()
        got = matvec.matvec(view, weight, b)
        assert got.shape == (*view.shape[:-1], 40)
        torch.testing.assert_close(got.double(), reference(view, weight, b), atol=1e-4, rtol=1e-5)


@native
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it():
    # Batched and one-at-a-time decoding then agree exactly while the kernel serves both.
    weight, b = torch.randn(101, 300), torch.randn(101)
    x = torch.randn(4, 300)
    alone = torch.cat([matvec.matvec(x[i : i + 1], weight, b) for i in range(4)])
    for rows in (2, 3, 4):
        assert torch.equal(matvec.matvec(x[:rows], weight, b), alone[:rows])
    assert torch.equal(matvec.matvec(x.flip(0), weight, b), alone.flip(0))


@native
@pytest.mark.skipif(not prepack_available(), reason="torch built without oneDNN")
def test_a_packed_linear_sends_up_to_four_rows_through_the_kernel(monkeypatch):
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear)
    assert packed.native
    calls = []
    real = matvec.matvec
    monkeypatch.setattr(matvec, "matvec", lambda *a: calls.append(1) or real(*a))
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
    assert matvec.load() is None
    if prepack_available():
        linear = nn.Linear(16, 8)
        packed = PackedLinear(linear)
        assert not packed.native
        x = torch.randn(1, 16)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_the_environment_can_turn_the_kernel_off(monkeypatch, reload_kernel):
    monkeypatch.setenv("TFORMER_NATIVE", "0")
    assert matvec.load() is None


@native
def test_a_fresh_cache_builds_the_kernel_and_leaves_no_temporary_files(
    monkeypatch, tmp_path, reload_kernel
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert matvec.load() is not None
    built = sorted(p.name for p in (tmp_path / "tformer").iterdir())
    assert len(built) == 1 and built[0].startswith("matvec-") and built[0].endswith(".so")
