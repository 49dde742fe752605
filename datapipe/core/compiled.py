"""numba's `njit`, cached, for every compiled loop of the project (near dedup's, the filters', the loader's).

Cached where numba can write a cache: beside the source (`cache=True`, like Python's own `__pycache__`) or in the
user's cache folder, so a later process loads the loops instead of compiling them. Imported only by the kernel
modules: nothing else pays for importing numba. Tables the loops read that take a while to make (`cached_arrays`)
are kept beside them."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import sys
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numba
import numpy as np
from filelock import FileLock


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
    slower to start); compiled by one process of a machine at a time (`compile_lock`)."""
    def decorate(function: Callable) -> Callable:
        dispatcher = numba.njit(cache=CACHE, nogil=True, **options)(function)
        if CACHE:
            _compile_one_at_a_time(dispatcher, compile_lock(dispatcher))
        return dispatcher
    return decorate


def _cache_folder(source_file: str) -> Path:
    """Where numba caches the loops of `source_file`: NUMBA_CACHE_DIR, else the `__pycache__` beside it."""
    return Path(os.environ.get("NUMBA_CACHE_DIR") or Path(source_file).parent / "__pycache__")


def compile_lock(dispatcher: Any) -> Path:
    """The loop's lock file: in the folder numba's own locator chose for its cache (beside the source, else the
    user's cache folder), named by its source file and name."""
    source = inspect.getfile(dispatcher.py_func)
    folder = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None) or _cache_folder(source)
    return Path(folder) / f"{Path(source).stem}.{dispatcher.py_func.__qualname__}.compile.lock"


_COMPILING = threading.local()  # whether this thread holds a loop's lock (a loop's compile types its callees)


def _compile_one_at_a_time(dispatcher: Any, lock_file: Path) -> None:
    """The dispatcher's compiles (on a first call, or when a caller's compile types it) hold the loop's lock file.
    A cold node's workers all reach the same loops at once: one compiles and caches each loop while the others wait
    for it, then load it from the cache instead of each compiling its own copy (different loops still compile side by
    side). Nested compiles take no second lock (one lock a process at a time, so two processes cannot wait on each
    other); where no lock file can be made the loop compiles unlocked."""
    compile_now = dispatcher.compile

    def compile_locked(signature: Any) -> Any:
        if getattr(_COMPILING, "holding", False):
            return compile_now(signature)
        try:
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(lock_file)
            lock.acquire()
        except OSError:
            return compile_now(signature)
        _COMPILING.holding = True
        try:
            return compile_now(signature)
        finally:
            _COMPILING.holding = False
            lock.release()

    dispatcher.compile = compile_locked


def cached_arrays(source_file: str, name: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`build()`'s arrays, kept as `<name>-<key>.npz` where numba keeps the loops of `source_file` (NUMBA_CACHE_DIR,
    else the `__pycache__` beside it), so that a later process loads them instead of making them. The key is the
    Python build and `build`'s source, so a new Python (its Unicode tables) or a changed `build` makes them again; so
    does a missing or damaged file, or a folder nothing can be written to (then each process makes them)."""
    key = hashlib.sha256(f"{sys.version}\n{inspect.getsource(build)}".encode()).hexdigest()[:16]
    folder = _cache_folder(source_file)
    path = folder / f"{name}-{key}.npz"
    try:
        with np.load(path) as saved:
            return {k: saved[k] for k in saved.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # none yet, or damaged: made again
        pass
    arrays = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".{path.name}.{os.getpid()}"
        with open(temporary, "wb") as f:
            np.savez(f, **arrays)
        os.replace(temporary, path)
    except OSError:
        pass
    return arrays
