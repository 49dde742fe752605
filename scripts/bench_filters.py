"""The quality filters' MB of text per CPU-second: compiled (stages.quality) against the Python reference and
datatrove, each filter alone and web.yaml's chain, and every document's decision compared; prints one JSON object.

    python -m scripts.bench_filters [--corpus ../shared/data/corpus.jsonl.gz] [--docs N] [--no-datatrove]

The filters are configs/web.yaml's, with its settings: its "*" chain (gopher_quality, gopher_repetition, c4, fineweb,
in that order, the first failure decides) runs on every document, as web.yaml's single `web` domain has it, and the
code filter of its `code` domain runs alone. One process, one core (`OMP_NUM_THREADS=1`, set before numpy loads); CPU
is `time.process_time` (this process does all the work: no threads, no children). The compiled filters check
batches of `read.batch_size` documents through `stages.base.first_failures`, as the filters stage does; their
kernels are compiled (or loaded from numba's cache) and the character tables built before the clock starts
(`setup_cpu_s` reports that once-per-process cost). `mismatches` counts documents whose decision or reason differs
from `datapipe.testing.quality_reference` (the Python the kernels replaced): the goal is 0.

datatrove's filters (`--no-datatrove` skips them; they need `pip install datatrove spacy`, which the project does not
depend on) check one `Document` at a time with their default settings, which are web.yaml's thresholds; they
tokenize words with spaCy where ours use one regex, so their decisions are not compared, only their speed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import numba  # noqa: E402
import pyarrow as pa  # noqa: E402
import yaml  # noqa: E402

from datapipe.curation.config import ReadConfig  # noqa: E402
from datapipe.testing.quality_reference import REFERENCE_FILTERS  # noqa: E402
from stages.base import DocumentFilter, first_failures  # noqa: E402
from stages.quality import build_filters  # noqa: E402

WEB_YAML = Path(__file__).parents[1] / "configs" / "web.yaml"


def load(corpus: str, docs: int | None) -> list[str]:
    with gzip.open(corpus, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    return texts[:docs] if docs else texts


def _cpu(run: Callable[[], Any]) -> tuple[float, Any]:
    started = time.process_time()
    out = run()
    return time.process_time() - started, out


def compiled(filters: Sequence[DocumentFilter], texts: list[str], batch_size: int) -> list[str | None]:
    reasons: list[str | None] = []
    for i in range(0, len(texts), batch_size):
        reasons += first_failures(filters, pa.array(texts[i:i + batch_size], type=pa.large_string()))
    return reasons


def reference(filters: Sequence[DocumentFilter], texts: list[str]) -> list[str | None]:
    """The chain as `FilterStage` ran it before: each document through each Python check in turn."""
    reasons: list[str | None] = []
    for text in texts:
        reason = None
        for f in filters:
            if (detail := f.check(text)) is not None:
                reason = f"{f.name}:{detail}"
                break
        reasons.append(reason)
    return reasons


def datatrove_chain(names: Sequence[str], texts: list[str]) -> Callable[[], int]:
    """A run of datatrove's filters named like ours over `texts` (first failure decides); how many it dropped."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    classes = {"gopher_quality": GopherQualityFilter, "gopher_repetition": GopherRepetitionFilter,
               "c4": C4QualityFilter, "fineweb": FineWebQualityFilter}
    filters = [classes[n]() for n in names]

    def run() -> int:
        dropped = 0
        for i, text in enumerate(texts):
            doc = Document(text=text, id=str(i))
            for f in filters:
                kept = f.filter(doc)
                if kept is not True and (kept is False or not kept[0]):
                    dropped += 1
                    break
        return dropped
    return run


def measure(name: str, filters: list[DocumentFilter], texts: list[str], mb: float, batch_size: int,
            with_datatrove: bool) -> dict[str, Any]:
    refs = [REFERENCE_FILTERS[f.name](f.config) for f in filters]
    new_s, got = _cpu(lambda: compiled(filters, texts, batch_size))
    ref_s, want = _cpu(lambda: reference(refs, texts))
    out: dict[str, Any] = {
        "filters": [f.name for f in filters],
        "compiled_mb_per_cpu_s": round(mb / new_s, 2),
        "reference_mb_per_cpu_s": round(mb / ref_s, 3),
        "speedup_vs_reference": round(ref_s / new_s, 1),
        "compiled_cpu_s": round(new_s, 2),
        "reference_cpu_s": round(ref_s, 2),
        "dropped": sum(r is not None for r in want),
        "mismatches": sum(g != w for g, w in zip(got, want)),
    }
    if out["mismatches"]:
        out["first_mismatches"] = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w][:5]
    if with_datatrove and name != "code":
        dt_s, dt_dropped = _cpu(datatrove_chain(out["filters"], texts))
        out.update(datatrove_mb_per_cpu_s=round(mb / dt_s, 3), speedup_vs_datatrove=round(dt_s / new_s, 1),
                   datatrove_cpu_s=round(dt_s, 2), datatrove_dropped=dt_dropped)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    parser.add_argument("--docs", type=int, default=None, help="the corpus's first N documents (default: all)")
    parser.add_argument("--no-datatrove", action="store_true", help="skip datatrove's filters")
    args = parser.parse_args()

    texts = load(args.corpus, args.docs)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    per_domain, chain = build_filters(yaml.safe_load(WEB_YAML.read_text())["filters"])
    batch_size = ReadConfig().batch_size
    setup_s, _ = _cpu(lambda: compiled([*chain, *per_domain["code"]], texts[:50], batch_size))

    results: dict[str, Any] = {}
    for f in [*chain, *per_domain["code"]]:
        results[f.name] = measure(f.name, [f], texts, mb, batch_size, not args.no_datatrove)
    results["web.yaml chain"] = measure("chain", chain, texts, mb, batch_size, not args.no_datatrove)
    print(json.dumps({
        "corpus": args.corpus, "documents": len(texts), "mb": round(mb, 1), "batch_size": batch_size,
        "setup_cpu_s": round(setup_s, 2), "numba": numba.__version__, "python": platform.python_version(),
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
