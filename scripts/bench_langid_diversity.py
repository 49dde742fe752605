"""Language-id accuracy and diversity-sampling quality on the shared corpus; prints one JSON object.

usage: python -m scripts.bench_langid_diversity [--corpus ../shared/data/corpus.jsonl.gz] [--english 1000]

- Language id: every translated manual page plus `--english` English ones; the man folder is the
  truth (pt_BR -> pt, zh_CN/zh_TW -> zh). Accuracy per language, and MB/s of the stage.
- Diversity: for each domain, a diversity sample and 10 random samples of the same size (10% and
  25% of the documents); the Vendi score (cosine kernel on the stage's own features) and the
  distinct token-3-gram ratio of each. Token ids come from a byte-level BPE trained on the domain.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from stages import diversity
from stages.langid import LangIdConfig, LangIdStage
from stages.tokenize import TokenizerConfig, TokenizerTrainConfig, train_tokenizer

FOLDER_TO_LANG = {"pt_BR": "pt", "zh_CN": "zh", "zh_TW": "zh"}


def langid_accuracy(rows: list[dict], english: int) -> dict:
    man = [r for r in rows if r["source"] == "man"]
    other = [r for r in man if r["lang"] != "en"]
    en = [r for r in man if r["lang"] == "en"]
    pages = other + random.Random(0).sample(en, min(english, len(en)))
    batch = pa.RecordBatch.from_pylist(
        [{"id": r["id"], "domain": "man", "text": r["text"], "order": i} for i, r in enumerate(pages)], schema=DOC_SCHEMA
    )
    stage = LangIdStage(LangIdConfig(enabled=True))
    stage.classify("warm up")
    t0 = time.perf_counter()
    got = stage(batch).kept.column("lang").to_pylist()
    seconds = time.perf_counter() - t0
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    confusion: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r, g in zip(pages, got):
        truth = FOLDER_TO_LANG.get(r["lang"], r["lang"])
        per[truth][0] += g == truth
        per[truth][1] += 1
        if g != truth:
            confusion[truth][g] += 1
    mb = sum(len(r["text"].encode()) for r in pages) / 1e6
    return {
        "pages": len(pages),
        "accuracy": round(sum(c for c, _ in per.values()) / len(pages), 4),
        "accuracy_without_english": round(
            sum(c for k, (c, _) in per.items() if k != "en") / sum(n for k, (_, n) in per.items() if k != "en"), 4),
        "MB_per_s_one_core": round(mb / seconds, 2),
        "per_language": {k: {"pages": n, "accuracy": round(c / n, 3), "mistaken_for": dict(confusion[k].most_common(2))}
                         for k, (c, n) in sorted(per.items())},
    }


def diversity_vs_random(rows: list[dict], domain: str, limit: int) -> dict:
    docs = [r["text"] for r in rows if r["source"] == domain][:limit]
    cfg = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=4096, sample_bytes=10**9))
    tok = train_tokenizer(docs[:800], cfg)
    toks = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(docs)]
    x = diversity.features(toks, 1024)
    ids = [f"{domain}{i}" for i in range(len(docs))]
    centroids = diversity.kmeans(x, diversity.default_clusters(len(docs)), 25, seed=0)
    clusters = diversity.assign_clusters(x, centroids)
    out = {"docs": len(docs), "clusters": len(centroids)}
    for frac in (0.1, 0.25):
        keep = diversity.select(clusters, diversity.seeded_rank(ids, 0), np.array([len(t) for t in toks]), frac)
        n = int(keep.sum())
        chosen = np.flatnonzero(keep)
        randoms = [np.random.default_rng(s).choice(len(docs), n, replace=False) for s in range(10)]
        vendi_r = [diversity.vendi_score(x[r]) for r in randoms]
        ngram_r = [diversity.distinct_ngram_ratio([toks[i] for i in r]) for r in randoms]
        v, g = diversity.vendi_score(x[chosen]), diversity.distinct_ngram_ratio([toks[i] for i in chosen])
        out[f"{int(frac * 100)}%"] = {
            "docs": n,
            "vendi_diversity": round(v, 2),
            "vendi_random_mean": round(float(np.mean(vendi_r)), 2),
            "vendi_random_max": round(float(np.max(vendi_r)), 2),
            "vendi_ratio": round(v / float(np.mean(vendi_r)), 3),
            "distinct_3gram_diversity": round(g, 4),
            "distinct_3gram_random_mean": round(float(np.mean(ngram_r)), 4),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--english", type=int, default=1000)
    p.add_argument("--docs-per-domain", type=int, default=2000)
    args = p.parse_args()
    with gzip.open(Path(args.corpus), "rb") as f:
        rows = [orjson.loads(line) for line in f]
    results = {"langid": langid_accuracy(rows, args.english), "diversity": {}}
    for domain in ("man", "license", "code"):
        results["diversity"][domain] = diversity_vs_random(rows, domain, args.docs_per_domain)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
