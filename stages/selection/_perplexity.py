"""Perplexity under a small model of the target: a hashed word-bigram language model (CCNet used KenLM's 5-grams).

p(w | v) = l(v) * c(v, w) / c(v) + (1 - l(v)) * p(w), with p(w) the Laplace-smoothed unigram frequency and
l(v) = c(v) / (c(v) + K) (Witten-Bell style: a context seen often trusts its bigrams). Words and pairs are
hashed into buckets (`_ngrams`), so the model is three arrays. A document's log perplexity is its mean
negative log-likelihood per word.

Selection keeps a band: the documents whose log perplexity is nearest the target's own typical value (the
median over target documents the model was not fit on), so both what the model finds far too surprising
(off-target text) and far too predictable (boilerplate, repeated lines) go first.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from stages.selection._ngrams import bigram_buckets, unigram_buckets, word_hashes

CONTEXT_PRIOR = 5.0  # K: the context count at which bigrams and unigrams weigh the same


@dataclass(frozen=True)
class BigramModel:
    unigram: np.ndarray  # (buckets,) counts of words
    bigram: np.ndarray  # (buckets,) counts of word pairs
    center: float = 0.0  # the target's median log perplexity on documents the counts did not see

    @classmethod
    def fit(cls, texts: list[str], held: list[str], *, buckets: int = 1 << 20) -> "BigramModel":
        uni = np.zeros(buckets, np.float64)
        bi = np.zeros(buckets, np.float64)
        for text in texts:
            words = word_hashes(text)
            np.add.at(uni, unigram_buckets(words, buckets), 1.0)
            np.add.at(bi, bigram_buckets(words, buckets), 1.0)
        model = cls(uni, bi)
        values = model.log_perplexity(held)
        return cls(uni, bi, float(np.median(values)) if len(values) else 0.0)

    def log_perplexity(self, texts: list[str]) -> np.ndarray:
        buckets = len(self.unigram)
        p_uni = (self.unigram + 1.0) / (self.unigram.sum() + buckets)
        out = np.empty(len(texts), np.float64)
        for i, text in enumerate(texts):
            words = word_hashes(text)
            if len(words) == 0:
                out[i] = np.inf
                continue
            u = unigram_buckets(words, buckets)
            context = self.unigram[u[:-1]]
            lam = context / (context + CONTEXT_PRIOR)
            p_pair = np.where(context > 0, self.bigram[bigram_buckets(words, buckets)] / np.maximum(context, 1.0), 0.0)
            p = np.concatenate([p_uni[u[:1]], lam * p_pair + (1.0 - lam) * p_uni[u[1:]]])
            out[i] = -float(np.mean(np.log(p)))
        return out

    def band_scores(self, texts: list[str]) -> np.ndarray:
        """Higher is nearer the target's typical log perplexity: -|log ppl - center|."""
        return -np.abs(self.log_perplexity(texts) - self.center)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, kind="perplexity", unigram=self.unigram.astype(np.float32), bigram=self.bigram.astype(np.float32),
                 center=np.float64(self.center))
        return buffer.getvalue()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "BigramModel":
        return cls(arrays["unigram"].astype(np.float64), arrays["bigram"].astype(np.float64), float(arrays["center"]))

