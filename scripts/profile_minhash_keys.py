"""Where near dedup's map half spends its CPU, part by part, on the shared corpus; prints one JSON object.

usage: python -m scripts.profile_minhash_keys [--corpus ../shared/data/corpus.jsonl.gz] [--tree DIR] [--rounds 2]

Each part runs over the whole corpus in batches of 2,000 documents (as `bench_near_dedup`'s harness and the
segment tasks do), the best of `--rounds` by process CPU time. The parts nest: lowering the text; the word hashes (lowering, then
finding and hashing the words in one compiled pass); the shingle hashes (those and the windows); the keys (those,
the permutations' minimum, the bands and partitions: what `write_keys` computes). The compiled loops are loaded
(`minhash_kernels`, numba) before any part is timed, and that load is reported on its own. Then, for the harness's share, writing each 8 MB block as a read block (a frame per text)
and reading it back. `--tree DIR` times another checkout's `stages/minhash.py` keys instead (a side-by-side
check that the signature code itself did not change speed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import orjson

BATCH = 2_000


def _best(fn: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return round(best, 3)


def _table(texts: list[str]) -> Any:
    import numpy as np
    import pyarrow as pa

    from datapipe.core.schema import DOC_SCHEMA

    n = len(texts)
    return pa.table({"id": [str(i) for i in range(n)], "domain": ["d"] * n, "text": pa.array(texts, pa.large_string()),
                     "order": np.arange(n, dtype=np.int64), "lang": pa.nulls(n, pa.string()),
                     "lang_score": pa.nulls(n, pa.float32())}, schema=DOC_SCHEMA)


def _parts(table: Any, rounds: int) -> dict[str, float]:
    import stages.minhash as mh

    cfg, texts = mh.MinHashConfig(), table.column("text").combine_chunks()
    batches = [texts.slice(i, BATCH) for i in range(0, len(texts), BATCH)]
    return {
        "shingles": int(sum(len(mh.shingle_hashes64(b, cfg)[0]) for b in batches)),
        "lowered_s": _best(lambda: [mh._lowered(b) for b in batches], rounds),
        "word_hashes_s": _best(lambda: [mh._vector_units(b, True, cfg.words) for b in batches], rounds),
        "shingle_hashes_s": _best(lambda: [mh.shingle_hashes64(b, cfg) for b in batches], rounds),
    }


def _read_blocks(table: Any, rounds: int) -> dict[str, float]:
    import numpy as np
    import pyarrow.compute as pc

    from datapipe.curation.blocks import READ, block_documents, write_read_block

    sizes = pc.binary_length(table.column("text")).to_numpy()
    cuts = np.unique(np.r_[np.searchsorted(np.cumsum(sizes), np.arange(8 << 20, int(sizes.sum()) + (8 << 20), 8 << 20),
                                           side="right"), len(sizes)])
    blocks = [table.slice(int(a), int(b - a)) for a, b in zip(np.r_[0, cuts[:-1]], cuts) if b > a]
    with tempfile.TemporaryDirectory(prefix="profile-keys-") as t:
        work = Path(t)
        write = _best(lambda: [write_read_block(work, f"b{i:05d}", b, "zstd") for i, b in enumerate(blocks)], rounds)
        read = _best(lambda: [block_documents(work, READ, f"b{i:05d}", locate=True) for i in range(len(blocks))], rounds)
    return {"write_read_blocks_s": write, "read_blocks_back_s": read, "blocks": len(blocks)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus.jsonl.gz"))
    p.add_argument("--tree", default=None, help="another checkout whose stages/minhash.py keys are timed instead")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
        for name in [m for m in sys.modules if m == "stages" or m.startswith("stages.")]:
            del sys.modules[name]
    import stages.minhash as mh
    from importlib.metadata import version

    with gzip.open(args.corpus, "rb") as f:
        texts = [orjson.loads(line)["text"] for line in f]
    table = _table(texts)
    stage = mh.MinHashStage(mh.MinHashConfig())
    t0 = time.process_time()
    stage.keys(table.slice(0, 1).to_batches()[0])  # imports numba and loads (or compiles) the kernels
    load = round(time.process_time() - t0, 3)
    batches = [table.slice(i, BATCH).to_batches()[0] for i in range(0, table.num_rows, BATCH)]
    result: dict[str, Any] = {"documents": table.num_rows, "minhash_module": mh.__file__,
                              "versions": {n: version(n) for n in ("numpy", "pyarrow")},
                              "first_call_s": load, "keys_s": _best(lambda: [stage.keys(b) for b in batches], args.rounds)}
    if not args.tree:
        result.update(_parts(table, args.rounds))
        result.update(_read_blocks(table, args.rounds))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
