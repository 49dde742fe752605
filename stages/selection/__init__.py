"""Selection by a model: the classifier (`_classifier`), importance resampling (`_importance`), the perplexity band (`_perplexity`) over hashed word n-grams (`_ngrams`)

One score per document, from a model fit once in the driver and shipped to the workers. Methods (`selection.method` in a recipe):
- `classifier`  `_classifier`: the logit of a linear n-gram classifier of the target against the corpus;
- `dsir`        `_importance`: the log importance weight toward the target (of a fixed-length chunk with the
                document's mean n-gram ratio, as the paper weighs chunks) plus seeded Gumbel noise, so that
                keeping the top documents draws them in proportion to their weight (Gumbel top-k);
- `perplexity`  `_perplexity`: nearness of the log perplexity under a bigram model of the target to the
                target's own median (a band around it);
- `fasttext`    `_fasttext`: the probability an existing fastText classifier (a published model file, e.g. DCLM's)
                gives a label, the model applied as it is;
- `random`      seeded Gumbel noise alone: a uniform random subset of the same size (the baseline).
Higher scores are kept first. A `SelectionModel` also carries `knots`, quantiles of the scores of the corpus
sample it was fit against: `rank` maps scores through them, so that ranks spread evenly over the histogram
buckets of the exact cut (`datapipe.curation.cuts`) whatever the scores' scale.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from stages.selection._importance import ImportanceModel, gumbel
from stages.selection._ngrams import word_hashes
from stages.selection._perplexity import BigramModel
from stages.selection._classifier import QualityClassifier
from stages.selection._fasttext import FastTextScorer

Method = Literal["classifier", "dsir", "perplexity", "fasttext", "random"]
STAGE_NAMES = {"classifier": "quality_classifier", "dsir": "dsir", "perplexity": "perplexity", "fasttext": "fasttext",
               "random": "random_selection"}
SCORING_FLOPS_PER_TOKEN = {"classifier": 4.0, "dsir": 4.0, "perplexity": 8.0, "random": 0.0}  # fasttext: its model's
FIT_ITERATIONS = 200  # the classifier's L-BFGS iterations at most
# The kind of model each method's file holds (the `kind` its `to_bytes` writes) and its class; random holds none.
INNER_KINDS: dict[str, tuple[str | None, Any]] = {
    "classifier": ("quality_classifier", QualityClassifier), "dsir": ("importance", ImportanceModel),
    "perplexity": ("perplexity", BigramModel), "fasttext": ("fasttext", FastTextScorer), "random": (None, None)}
KNOTS = 4095  # score quantiles: one rank bucket between two of them (cuts.BUCKETS = 4096)
_LOW_BITS = 52  # the rank's bits below its bucket: the score's own order within a bucket


@dataclass(frozen=True)
class SelectionModel:
    method: str
    seed: int
    model: Any  # QualityClassifier | ImportanceModel | BigramModel | FastTextScorer | None (random)
    knots: np.ndarray  # (KNOTS,) ascending
    fit_flops: float = 0.0  # what fitting it cost: the model's fit (`model_flops`) and scoring the corpus sample for the knots
    fit_cpu_seconds: float = 0.0  # CPU seconds its fit took, its corpus sample's reading included (set by the caller)

    def scoring_flops(self, tokens: int) -> float:
        """An upper estimate of the FLOPs of scoring documents of `tokens` tokens: a multiply-add per n-gram (a unigram
        and a bigram per word, and a word is at least one token), twice that for the bigram model's mixture; for a
        fastText model, its vectors' multiply-adds per word."""
        if self.method == "fasttext":
            return self.model.flops_per_word() * float(tokens)
        return SCORING_FLOPS_PER_TOKEN[self.method] * float(tokens)

    def scores(self, texts: list[str], ids: list[str]) -> np.ndarray:
        """One finite score per document; higher is kept first."""
        if self.method == "classifier":
            values = self.model.scores(texts)
        elif self.method == "dsir":
            values = self.model.log_weights(texts) + gumbel(ids, self.seed)
        elif self.method == "perplexity":
            values = self.model.band_scores(texts)
        elif self.method == "fasttext":
            values = self.model.scores(texts)
        else:
            values = gumbel(ids, self.seed)
        return np.nan_to_num(np.asarray(values, np.float64), nan=-1e300, neginf=-1e300, posinf=1e300)

    def rank(self, scores: np.ndarray) -> np.ndarray:
        """uint64 ranks, ascending as scores descend: the bucket (top 12 bits) counts the knots above the score,
        the low bits order scores inside a bucket."""
        negated = -np.asarray(scores, np.float64)
        bucket = np.searchsorted(-self.knots[::-1], negated, side="right").astype(np.uint64)
        bits = negated.view(np.uint64)
        sortable = np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))  # IEEE order as unsigned order
        return (bucket << np.uint64(_LOW_BITS)) | (sortable >> np.uint64(64 - _LOW_BITS))

    def to_bytes(self) -> bytes:
        inner = self.model.to_bytes() if self.model is not None else b""
        buffer = io.BytesIO()
        # its fit's CPU seconds stay out (the fit task's record keeps them): a time would make the same fit other bytes
        np.savez(buffer, method=self.method, seed=np.int64(self.seed), knots=self.knots, model=np.frombuffer(inner, np.uint8),
                 fit_flops=np.float64(self.fit_flops))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "SelectionModel":
        """The model `to_bytes` wrote; a ValueError saying what is wrong with anything else (a damaged file, another
        kind of file, a model whose inner arrays are not its method's)."""
        try:
            with np.load(io.BytesIO(data)) as f:
                method, seed, knots, inner = str(f["method"]), int(f["seed"]), f["knots"], f["model"].tobytes()
                fit_flops = float(f["fit_flops"])
                fit_cpu = float(f["fit_cpu_seconds"]) if "fit_cpu_seconds" in f.files else 0.0  # files saved before
            arrays = {}
            if inner:
                with np.load(io.BytesIO(inner)) as g:
                    arrays = {k: g[k] for k in g.files}
        except KeyError as exc:
            raise ValueError(f"it holds no {exc.args[0]!r} entry: not a selection model's file") from None
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:  # cut, a flipped bit, not an .npz
            raise ValueError(f"not a readable .npz file, damaged or of another kind ({type(exc).__name__}: {exc})") from None
        if method not in INNER_KINDS:
            raise ValueError(f"its method {method!r} is none of {sorted(INNER_KINDS)}")
        kind = str(arrays["kind"]) if "kind" in arrays else None
        if kind != INNER_KINDS[method][0]:
            raise ValueError(f"its method is {method!r} but it holds {'a ' + repr(kind) if kind else 'no'} model")
        model = INNER_KINDS[method][1].from_arrays(arrays) if kind else None
        return cls(method, seed, model, knots, fit_flops, fit_cpu)


def fit(method: Method, target: list[str], corpus: list[str], corpus_ids: list[str], seed: int,
        scorer: FastTextScorer | None = None) -> SelectionModel:
    """Fit `method`'s model on the `target` documents against a sample of the `corpus` (texts and ids); the knots
    come from that sample's scores. `fasttext` fits nothing: it takes its `scorer` (an existing model) as it is."""
    if method == "fasttext":
        model: Any = scorer
    elif method == "classifier":
        model = QualityClassifier.fit(target, corpus, iterations=FIT_ITERATIONS)
    elif method == "dsir":
        model = ImportanceModel.fit(target, corpus)
    elif method == "perplexity":  # counts from half the target, the band's center from the other half
        fit_half = [t for i, t in enumerate(target) if i % 2 == 0]
        model = BigramModel.fit(fit_half, [t for i, t in enumerate(target) if i % 2 == 1] or fit_half)
    else:
        model = None
    unfit = SelectionModel(method, seed, model, np.zeros(KNOTS))
    scores = np.sort(unfit.scores(corpus, corpus_ids)) if corpus else np.zeros(1)
    knots = np.quantile(scores, (np.arange(KNOTS) + 1) / (KNOTS + 1))
    corpus_words = sum(len(word_hashes(t)) for t in corpus)
    return SelectionModel(method, seed, model, knots, model_flops(method, model, target, corpus) + unfit.scoring_flops(corpus_words))


def model_flops(method: Method, model: Any, target: list[str], corpus: list[str]) -> float:
    """FLOPs of fitting the model itself (none for an existing fastText model: its training is not this run's): the classifier's as its fit counted them (its optimizer's own work
    included); for the count models an addition per n-gram counted (a unigram and a bigram per word: DSIR counts
    the target and the corpus sample, the bigram model its half of the target twice, unigrams and pairs)."""
    if method == "classifier":
        return model.fit_flops
    if method == "dsir":
        return 2.0 * sum(len(word_hashes(t)) for t in [*target, *corpus])
    if method == "perplexity":
        return 4.0 * sum(len(word_hashes(t)) for i, t in enumerate(target) if i % 2 == 0)
    return 0.0
