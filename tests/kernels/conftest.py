import os
import shutil

import pytest

from tformer.kernels import int8, library


@pytest.fixture
def reload_kernel():
    """Forget the loaded decoding kernel before and after the test, so that `library.load()`
    looks again under the environment the test sets (and later tests get the usual one)."""
    library.load.cache_clear()
    yield
    library.load.cache_clear()


def use_isa(name: str, monkeypatch) -> str:
    monkeypatch.setenv("TFORMER_ISA", name)
    library.load.cache_clear()
    if int8.isa() != name:
        pytest.skip(f"this CPU or build does not run {library.ISA_NAMES[name]}")
    return name


@pytest.fixture(params=library.ISAS)
def isa(request, monkeypatch, reload_kernel):
    """Each instruction set the int8 products can run on (TFORMER_ISA), in turn: tests that
    take this fixture run once under each this CPU has, and are skipped under the others."""
    return use_isa(request.param, monkeypatch)


@pytest.fixture(params=["avx512", "avxvnni", "avx2"])
def kernel_isa(request, monkeypatch, reload_kernel):
    """`isa` for the C kernels' instruction sets only."""
    return use_isa(request.param, monkeypatch)


@pytest.fixture(params=[int8.AVX2_WIDEN, int8.AVX2_SIGN], ids=["widen", "sign"])
def avx2_method(request):
    """Each of the AVX2 few-row int8 products in turn (load() keeps the faster on this CPU);
    the one load() chose is restored afterwards."""
    lib = library.load()
    if lib is None:
        pytest.skip("no C kernels here")
    chosen = lib.tformer_avx2_method(-1)
    lib.tformer_avx2_method(request.param)
    yield request.param
    lib.tformer_avx2_method(chosen)


@pytest.fixture(scope="session")
def fresh_build(tmp_path_factory):
    """The library as load() builds it in an empty cache (XDG_CACHE_HOME), once a session:
    the cache folder, and the files load() left in it. A whole build, some 20 to 40 s: the
    slow suite's (the fast one builds the library once a session where the cache lacks it,
    and tests compile_library with a stand-in compiler); the others take `session_build`."""
    if library.load() is None:
        pytest.skip("no C kernels here")
    cache = tmp_path_factory.mktemp("fresh-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    library.load.cache_clear()
    try:
        loaded = library.load() is not None
    finally:
        if before is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = before
        library.load.cache_clear()
    assert loaded
    return cache / "tformer", sorted(p.name for p in (cache / "tformer").iterdir())


@pytest.fixture(scope="session")
def session_build():
    """The library this session loads (built in the usual cache where it lacked it): its
    folder and file name."""
    lib = library.load()
    if lib is None:
        pytest.skip("no C kernels here")
    path = library.cache_dir() / library.library_name(library.compiler())
    if not path.exists():
        pytest.skip("the session's library was built in a private folder")
    return path.parent, [path.name]


@pytest.fixture
def copy_build(session_build, monkeypatch):
    """library.compile_library copies the session's build instead of compiling."""
    folder, files = session_build

    def copy(compiler: str, path) -> None:
        shutil.copy(folder / files[0], path)

    monkeypatch.setattr(library, "compile_library", copy)
