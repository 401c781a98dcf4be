import pytest

from tformer.kernels import matvec


@pytest.fixture
def reload_kernel():
    """Forget the loaded decoding kernel before and after the test, so that `matvec.load()`
    looks again under the environment the test sets (and later tests get the usual one)."""
    matvec.load.cache_clear()
    yield
    matvec.load.cache_clear()
