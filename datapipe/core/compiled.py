"""numba's `njit`, cached, for every compiled loop of the project (near dedup's, the filters', the loader's).

Cached where numba can write a cache: beside the source (`cache=True`, like Python's own `__pycache__`) or in the
user's cache folder, so a later process loads the loops instead of compiling them. Imported only by the kernel
modules: nothing else pays for importing numba."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numba


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
