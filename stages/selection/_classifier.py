"""A quality classifier: a linear model over hashed word n-grams, trained on what you want against the corpus.

The DCLM / FineWeb-Edu recipe with fastText's model class: positives are documents of what the model should
be good at (the user's), negatives a seeded sample of the corpus being curated; features are a document's
hashed unigrams and bigrams (`_ngrams`), log-scaled and L2-normalised; the model is an L2-regularised
logistic regression, fit by L-BFGS to its optimum (deterministic: no shuffling, no learning-rate schedule; and the
same bits on every CPU and thread count: `_lbfgs` sums its inner products without BLAS).
The classes are weighted to equal total weight, so the score (the logit, log p(positive) - log p(corpus))
does not depend on how many of each were given. fastText's own wheel is not used: it calls numpy APIs
that numpy 2 removed.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from stages.selection import _lbfgs as lbfgs
from stages.selection._lbfgs import dot
from stages.selection._ngrams import count_matrix


def _features(texts: list[str], buckets: int) -> "scipy.sparse.csr_matrix":  # noqa: F821
    import scipy.sparse as sp  # imported when used (see `_ngrams.count_matrix`)

    m = count_matrix(texts, buckets)
    m.data = np.log1p(m.data)
    norms = np.sqrt(np.asarray(m.multiply(m).sum(1)).ravel())
    return sp.diags(1.0 / np.maximum(norms, 1e-12)) @ m


LBFGS_MEMORY = 10  # correction pairs L-BFGS keeps (scipy's L-BFGS-B default `maxcor`)
FEATURE_FLOPS_PER_NONZERO = 4  # building the features once: the count, its log1p, its square for the norm, the scaling
ROW_FLOPS = 30  # one evaluation's elementwise work per document: the logit's bias, a sigmoid, a logaddexp (an
                # exponential or logarithm counted as 8) and the weighted residual
PARAMETER_FLOPS = 6  # one evaluation's work per parameter: the penalty, its gradient and the gradient's assembly
# One L-BFGS iteration per parameter: the two-loop product of the compact form (2 m inner products and 2 m
# vector updates, a multiply-add each), the step and the new correction pair's two differences.
OPTIMIZER_FLOPS_PER_PARAMETER = 2 * 4 * LBFGS_MEMORY + 6


def fit_flops(nonzeros: int, documents: int, parameters: int, evaluations: int, iterations: int) -> float:
    """The FLOPs of a fit: the features once; per evaluation of the loss and its gradient, the two sparse products
    (a multiply-add per nonzero each) and the per-document and per-parameter work; per iteration, the optimizer's
    own work. From the counts the fit reports (its evaluations and iterations), not a bound."""
    evaluation = 2 * 2 * nonzeros + ROW_FLOPS * documents + PARAMETER_FLOPS * parameters
    return float(FEATURE_FLOPS_PER_NONZERO * nonzeros + evaluations * evaluation
                 + iterations * OPTIMIZER_FLOPS_PER_PARAMETER * parameters)


@dataclass(frozen=True)
class QualityClassifier:
    weights: np.ndarray  # (buckets,)
    bias: float
    fit_flops: float = 0.0  # what its fit cost (`fit_flops`); not saved: the selection model keeps the total

    @property
    def buckets(self) -> int:
        return len(self.weights)

    @classmethod
    def fit(cls, positives: list[str], negatives: list[str], *, buckets: int = 1 << 18, l2: float = 1e-4,
            iterations: int = 200) -> "QualityClassifier":
        import scipy.sparse as sp

        x = sp.vstack([_features(positives, buckets), _features(negatives, buckets)]).tocsr()
        y = np.concatenate([np.ones(len(positives)), np.zeros(len(negatives))])
        w = np.where(y == 1, 0.5 / max(len(positives), 1), 0.5 / max(len(negatives), 1))  # each class weighs 1/2

        def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
            z = x @ theta[:-1] + theta[-1]
            p = 1.0 / (1.0 + np.exp(-z))
            value = float(np.sum(w * (np.logaddexp(0.0, z) - y * z))) + 0.5 * l2 * dot(theta[:-1], theta[:-1])
            g = w * (p - y)
            return value, np.concatenate([x.T @ g + l2 * theta[:-1], [g.sum()]])

        result = lbfgs.minimize(loss, np.zeros(buckets + 1), memory=LBFGS_MEMORY, max_iterations=iterations)
        theta = result.x
        flops = fit_flops(x.nnz, x.shape[0], buckets + 1, result.evaluations, result.iterations)
        return cls(theta[:-1].astype(np.float32), float(theta[-1]), flops)

    def scores(self, texts: list[str]) -> np.ndarray:
        """The logit of each document: > 0 looks more like the positives than like the corpus."""
        if not texts:
            return np.empty(0, np.float64)
        return _features(texts, self.buckets) @ self.weights.astype(np.float64) + self.bias

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, kind="quality_classifier", weights=self.weights, bias=np.float64(self.bias))
        return buffer.getvalue()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "QualityClassifier":
        return cls(arrays["weights"].astype(np.float32), float(arrays["bias"]))
