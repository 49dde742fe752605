"""Tables the compiled loops read, made once and then loaded (`datapipe.core.compiled.cached_arrays`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from filelock import FileLock

from datapipe.core.compiled import cached_arrays


def test_arrays_are_made_once_then_loaded_and_made_again_when_their_file_is_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    made: list[int] = []

    def build() -> dict[str, np.ndarray]:
        made.append(1)
        return {"flags": np.array([0, 3, 255], np.uint8), "lower": np.arange(4, dtype=np.uint32) * 7}

    def same(arrays: dict[str, np.ndarray]) -> bool:
        return (sorted(arrays) == ["flags", "lower"] and arrays["flags"].dtype == np.uint8
                and arrays["flags"].tolist() == [0, 3, 255] and arrays["lower"].tolist() == [0, 7, 14, 21])

    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 1
    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 1  # loaded
    (saved,) = tmp_path.glob("tables-*.npz")
    saved.write_bytes(saved.read_bytes()[:40])  # cut short
    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 2
    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 2  # written again whole

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocked))
    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 3  # nowhere to keep them: made each time
    assert same(cached_arrays(__file__, "tables", build)) and len(made) == 4


_KERNEL = """
import json, sys
from datapipe.core.compiled import compile_lock, compiled

@compiled()
def triangle(n):
    total = 0
    for i in range(n):
        total += i
    return total

print(compile_lock(triangle), flush=True)
sys.stdin.readline()  # both processes go at once
assert triangle(10) == 45
print(json.dumps({"misses": sum(triangle.stats.cache_misses.values()), "hits": sum(triangle.stats.cache_hits.values())}))
"""


def test_processes_that_reach_a_loop_at_once_compile_it_once_and_the_others_load_it(tmp_path):
    """A cold node's workers reach the same loops together: while one holds the compile lock the others wait, then
    load what it cached. Both processes are let go at once, so without the lock both would compile (two misses)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "kernel.py").write_text(_KERNEL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.Popen([sys.executable, str(tmp_path / "kernel.py")], env=env, cwd=tmp_path, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    (lock_file,) = {run.stdout.readline().strip() for run in runs}
    assert lock_file.startswith(str(cache))
    with FileLock(lock_file):
        for run in runs:
            run.stdin.write("go\n")
            run.stdin.flush()
        time.sleep(1.0)
        assert all(run.poll() is None for run in runs)  # both wait at the lock
    outcomes = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        outcomes.append(json.loads(out))
    assert sorted((o["misses"], o["hits"]) for o in outcomes) == [(0, 1), (1, 0)]
