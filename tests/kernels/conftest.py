import pytest

from tformer.kernels import build, matvec


@pytest.fixture
def reload_kernel():
    """Forget the loaded decoding kernel before and after the test, so that `matvec.load()`
    looks again under the environment the test sets (and later tests get the usual one)."""
    matvec.load.cache_clear()
    yield
    matvec.load.cache_clear()


def use_isa(name: str, monkeypatch) -> str:
    monkeypatch.setenv("TFORMER_ISA", name)
    matvec.load.cache_clear()
    if matvec.isa() != name:
        pytest.skip(f"this CPU or build does not run {build.ISA_NAMES[name]}")
    return name


@pytest.fixture(params=build.ISAS)
def isa(request, monkeypatch, reload_kernel):
    """Each instruction set the int8 products can run on (TFORMER_ISA), in turn: tests that
    take this fixture run once under each this CPU has, and are skipped under the others."""
    return use_isa(request.param, monkeypatch)


@pytest.fixture(params=["avx512", "avx2"])
def kernel_isa(request, monkeypatch, reload_kernel):
    """`isa` for the C kernels' instruction sets only."""
    return use_isa(request.param, monkeypatch)
