"""Diversity's nearest-centroid step: the compiled distances (the same bits on every machine) against BLAS's float32
GEMM formula (what it replaced); prints one JSON object.

usage: python -m scripts.bench_kmeans_distances [--docs 20000] [--clusters 100] [--dims 1024] [--rounds 3]

On hashed n-gram bags of seeded random token lists (50-1,500 tokens: 700 nonzero entries a row of 1,024), the CPU
seconds of one assignment (`process_time`, best of `--rounds`; BLAS on one thread, as in a task), and the share of
rows both assign alike (they differ on near ties only: the compiled one sums in float64).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from stages import diversity  # noqa: E402
from stages.diversity_kernels import squared_distances  # noqa: E402


def _best(fn, rounds: int) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(rounds):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--clusters", type=int, default=100)
    p.add_argument("--dims", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    x = diversity.features([rng.integers(0, 30000, size=rng.integers(50, 1500)) for _ in range(args.docs)], args.dims)
    c = x[rng.choice(len(x), size=args.clusters, replace=False)].copy()
    squared_distances(x[:4], c)  # compiled (or loaded from the cache) before the clock starts
    compiled_s, compiled = _best(lambda: diversity.assign_clusters(x, c), args.rounds)
    blas_s, blas = _best(lambda: ((x * x).sum(1)[:, None] - 2 * x @ c.T + (c * c).sum(1)[None, :]).argmin(1), args.rounds)
    print(json.dumps({"docs": args.docs, "clusters": args.clusters, "dims": args.dims,
                      "nonzero_per_row": round(float((x != 0).sum(1).mean()), 1),
                      "compiled_cpu_s": round(compiled_s, 3), "blas_float32_cpu_s": round(blas_s, 3),
                      "slowdown": round(compiled_s / blas_s, 1), "same_assignment": float((compiled == blas).mean())}))


if __name__ == "__main__":
    main()
