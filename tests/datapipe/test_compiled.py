"""Tables the compiled loops read, made once and then loaded (`datapipe.core.compiled.cached_arrays`)."""

from __future__ import annotations

import numpy as np

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
