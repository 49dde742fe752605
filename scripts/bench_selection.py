"""CPU per MB of selection by a model beside the heuristic filters', on the shared corpus; prints one JSON object.

    python -m scripts.bench_selection [--corpus ../shared/data/corpus.jsonl.gz] [--docs 3000]

A seeded sample of `--docs` documents (every domain) is the corpus; Python documents outside it (at most 200) are the
target. In one process, one core (`OMP_NUM_THREADS=1` is set before numpy loads), measured with `time.process_time`:
- each heuristic filter (`stages.quality`, default parameters) checking every document: CPU seconds per MB of text;
- each selector (`stages.selection`): the fit (target + the corpus as its sample, the knots' scoring included) per
  MB of fit text, and the scoring of every document per MB of text.
The first pass of a selector over the text fills the word-hash cache that later passes reuse, as in a worker that
scores many blocks; the score is measured on a second pass (steady state) and the first (cold) is reported too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

from stages.quality import FILTERS  # noqa: E402
from stages.selection import _ngrams, fit  # noqa: E402


def load(corpus: str, docs: int, target_docs: int = 200) -> tuple[list[dict], list[str]]:
    with gzip.open(corpus, "rt") as f:
        rows = [json.loads(line) for line in f]
    picked = set(random.Random(0).sample(range(len(rows)), docs))
    sample = [rows[i] for i in sorted(picked)]
    target = [rows[i]["text"] for i in range(len(rows)) if i not in picked and rows[i]["source"] == "code"][:target_docs]
    return sample, target


def _mb(texts: list[str]) -> float:
    return sum(len(t.encode()) for t in texts) / 1e6


def filters(texts: list[str]) -> dict[str, float]:
    out = {}
    for name, (config_cls, filter_cls) in sorted(FILTERS.items()):
        check = filter_cls(config_cls()).check
        started = time.process_time()
        for text in texts:
            check(text)
        out[name] = round((time.process_time() - started) / _mb(texts), 4)
    return out


def selectors(texts: list[str], ids: list[str], target: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for method in ("classifier", "dsir", "perplexity", "random"):
        _ngrams._hashes.clear()  # every method starts cold
        started = time.process_time()
        model = fit(method, target, texts, ids, seed=0)
        fit_s = time.process_time() - started
        started = time.process_time()
        model.scores(texts, ids)
        warm = time.process_time() - started
        _ngrams._hashes.clear()
        started = time.process_time()
        model.scores(texts, ids)
        cold = time.process_time() - started
        out[method] = {"fit_cpu_s_per_mb": round(fit_s / (_mb(target) + _mb(texts)), 4),
                       "score_cpu_s_per_mb": round(warm / _mb(texts), 4), "score_cold_cpu_s_per_mb": round(cold / _mb(texts), 4),
                       "fit_flops": model.fit_flops}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    parser.add_argument("--docs", type=int, default=3000)
    args = parser.parse_args(argv)
    sample, target = load(args.corpus, args.docs)
    texts, ids = [r["text"] for r in sample], [r["id"] for r in sample]
    print(json.dumps({"docs": len(texts), "mb": round(_mb(texts), 2), "target_docs": len(target), "target_mb": round(_mb(target), 2),
                      "filters_cpu_s_per_mb": filters(texts), "selectors": selectors(texts, ids, target)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
