"""The compiled loop of `stages.diversity`: squared distances of feature rows to centroids, the same bits on every
machine.

numpy's `x @ c.T` is BLAS's GEMM, whose sums run in an order (and with fused multiply-adds) that depend on the CPU's
kernel and thread count: a document near two centroids could join one cluster here and the other there. Here each
distance is |x|^2 - 2 x.c + |c|^2 in float64 (a product of two float32 values is exact in it), every sum taken term by
term in index order (numba without fastmath neither reorders nor fuses them), x.c over x's nonzero entries only (the
features are hashed n-gram bags: most entries of a short document are zero).
"""

from __future__ import annotations

import numpy as np

from datapipe.core.compiled import compiled as _compiled


@_compiled()
def squared_distances(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(n, k) float64: the squared Euclidean distance of each row of `x` (n, d) to each row of `c` (k, d)."""
    n, d = x.shape
    k = c.shape[0]
    c_norms = np.zeros(k, np.float64)
    for j in range(k):
        s = 0.0
        for t in range(d):
            v = np.float64(c[j, t])
            s += v * v
        c_norms[j] = s
    out = np.empty((n, k), np.float64)
    nonzero = np.empty(d, np.int64)
    for i in range(n):
        m, x_norm = 0, 0.0
        for t in range(d):
            v = np.float64(x[i, t])
            if v != 0.0:
                nonzero[m] = t
                m += 1
                x_norm += v * v
        j = 0
        while j + 4 <= k:  # four centroids a pass over x's entries (each its own sum, in index order)
            d0 = d1 = d2 = d3 = 0.0
            for q in range(m):
                t = nonzero[q]
                v = np.float64(x[i, t])
                d0 += v * np.float64(c[j, t])
                d1 += v * np.float64(c[j + 1, t])
                d2 += v * np.float64(c[j + 2, t])
                d3 += v * np.float64(c[j + 3, t])
            out[i, j], out[i, j + 1] = x_norm - 2.0 * d0 + c_norms[j], x_norm - 2.0 * d1 + c_norms[j + 1]
            out[i, j + 2], out[i, j + 3] = x_norm - 2.0 * d2 + c_norms[j + 2], x_norm - 2.0 * d3 + c_norms[j + 3]
            j += 4
        while j < k:
            dot = 0.0
            for q in range(m):
                t = nonzero[q]
                dot += np.float64(x[i, t]) * np.float64(c[j, t])
            out[i, j] = x_norm - 2.0 * dot + c_norms[j]
            j += 1
    return out
