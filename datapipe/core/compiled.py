"""numba's `njit`, cached, for every compiled loop of the project (near dedup's, the filters', the loader's).

Cached where numba can write a cache: beside the source (`cache=True`, like Python's own `__pycache__`) or in the
user's cache folder, so a later process loads the loops instead of compiling them. Imported only by the kernel
modules: nothing else pays for importing numba."""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Iterator

import numba


class _NoScipyLinalg:
    """A finder that refuses `scipy.linalg` (an ImportError, as if scipy had no BLAS)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "scipy.linalg" or name.startswith("scipy.linalg."):
            raise ModuleNotFoundError(f"{name} is not loaded for numba's BLAS check", name=name)


@contextlib.contextmanager
def _without_scipy_linalg() -> Iterator[None]:
    finder = _NoScipyLinalg()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


# numba's array functions find out whether BLAS is there by importing scipy.linalg (a tenth of a CPU-second or more
# in every process that runs a compiled loop); no loop here calls BLAS, so numba is told there is none. Only while
# numba loads that module: scipy.linalg imports as usual for anyone else, before or after.
if "scipy.linalg" not in sys.modules:
    with _without_scipy_linalg():
        import numba.np.arraymath  # noqa: F401


def _identity(x: Any) -> Any:
    return x


def _can_cache() -> bool:
    """Whether numba finds a folder to cache compiled code in."""
    try:
        numba.njit(cache=True)(_identity)
    except RuntimeError as e:  # numba finds no writable folder for its cache
        warnings.warn(f"the compiled loops cannot be cached ({e}): each process compiles them. Set NUMBA_CACHE_DIR "
                      "to a writable folder to compile them once", stacklevel=2)
        return False
    return True


CACHE = _can_cache()


def compiled(**options: Any) -> Callable[[Callable], Callable]:
    """numba's `njit`, cached where `_can_cache` found a folder (else compiled in each process: the same results,
    slower to start)."""
    return numba.njit(cache=CACHE, nogil=True, **options)
