"""L-BFGS whose every inner product is summed in one fixed order, so a fit gives the same bits on every CPU.

scipy's L-BFGS-B calls BLAS (ddot, daxpy) on the parameter vector: OpenBLAS sums a dot product in an order, and with
fused multiply-adds, that depend on the kernel it picked for the CPU (`OPENBLAS_CORETYPE`) and its thread count, so
the same documents fit other weights on another machine or executor. Here a vector operation is numpy's elementwise
arithmetic (one rounding an element) and a dot product is the elementwise products summed by numpy's pairwise sum,
whose order is fixed by the array's length. The method is Nocedal & Wright's (algorithm 7.4, the two-loop recursion,
with a backtracking line search on the Armijo condition, pairs kept only with positive curvature); it stops as
scipy's L-BFGS-B does by default: the gradient's largest entry at most `gtol`, or the loss's relative decrease at
most `ftol`, or `max_iterations`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """a . b: exact products, summed in the fixed pairwise order of numpy's reduction (no BLAS)."""
    return float(np.add.reduce(np.multiply(a, b)))


@dataclass(frozen=True)
class Result:
    x: np.ndarray
    value: float
    iterations: int
    evaluations: int


def minimize(fun: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray, *, memory: int = 10,
             max_iterations: int = 200, gtol: float = 1e-5, ftol: float = 2.2e-9) -> Result:
    """The minimum of `fun` (value and gradient) from x0."""
    x = np.array(x0, dtype=np.float64)
    f, g = fun(x)
    evaluations, pairs = 1, []  # (s, y, 1 / y.s), newest last
    iteration = 0
    while iteration < max_iterations and float(np.max(np.abs(g), initial=0.0)) > gtol:
        direction = -_two_loop(g, pairs)
        slope = dot(g, direction)
        if slope >= 0:  # not a descent direction (lost curvature): restart from the gradient
            pairs, direction = [], -g
            slope = -dot(g, g)
        step = 1.0 if pairs else 1.0 / max(float(np.sqrt(dot(g, g))), 1.0)
        while True:
            x_new = x + step * direction
            f_new, g_new = fun(x_new)
            evaluations += 1
            if f_new <= f + 1e-4 * step * slope or step < 1e-20:
                break
            step *= 0.5
        s, y = x_new - x, g_new - g
        curvature = dot(y, s)
        if curvature > 1e-10 * dot(y, y):
            pairs = [*pairs, (s, y, 1.0 / curvature)][-memory:]
        decrease = f - f_new
        x, f, g = x_new, f_new, g_new
        iteration += 1
        if decrease <= ftol * max(abs(f), abs(f + decrease), 1.0):
            break
    return Result(x, f, iteration, evaluations)


def _two_loop(g: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray, float]]) -> np.ndarray:
    """The inverse-Hessian approximation times g (the identity scaled by the newest pair's s.y / y.y)."""
    q = g.copy()
    alphas = []
    for s, y, rho in reversed(pairs):
        alpha = rho * dot(s, q)
        q -= alpha * y
        alphas.append(alpha)
    if pairs:
        s, y, rho = pairs[-1]
        q *= 1.0 / (rho * dot(y, y))
    for (s, y, rho), alpha in zip(pairs, reversed(alphas)):
        beta = rho * dot(y, q)
        q += (alpha - beta) * s
    return q
