"""Where the tokenize phase's CPU goes, per part, in one process; prints one JSON object.

    python -m scripts.profile_tokenize [--corpus ../shared/data/corpus.jsonl.gz] [--docs N] [--tokenizer PATH]
                                       [--encoders auto,tokenizers]

Curates the corpus as `scripts.bench_tokenize`'s pipeline runs do (filters off, exact dedup on, one given tokenizer:
by default a byte-level BPE of 32,000 trained as that script trains it) on the in-process executor (`local`), so
that every tokenize task runs here, and profiles those tasks and the driver's building of the phase alone (cProfile,
`time.process_time` as its clock): one process does all of it, so each per-worker cost (building the encoder, the
sample check) counts once, as on one Ray worker.
For each encoder: the phase's CPU seconds and its parts, each the cumulative CPU of the calls that make it:
- `build_encoder`: each worker's `TokenizeStage` (the tokenizer parsed, the fast encoder built), once a process;
- `prove_fast_encoder`: `compile_bpe`, the proof that the fast encoder equals `tokenizers` (in the worker, or once in
  the driver where the phase carries it);
- `read_block`: a block's documents back from its read block (the read, its zstd frames decoded, the text column);
- `view`: the segment's rows of that block (the take by `order`);
- `to_pylist`: the texts as Python strings for the encoder;
- `verify`: the fast encoder's check of each worker's first `verify_bytes` against `tokenizers`;
- `encode`: the encoder's own calls (pre-tokenize and merges, inside tiktoken or `tokenizers`);
- `ids_to_arrow`: the id lists flattened into Arrow arrays;
- `write`: the token and lengths files written.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core, as in a Ray worker
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import orjson  # noqa: E402

from datapipe.core.config import from_dict  # noqa: E402
from datapipe.curation.config import CurateConfig  # noqa: E402
from datapipe.curation.executors import LocalExecutor  # noqa: E402
from datapipe.curation.phases import tokenize as tokenize_phase  # noqa: E402
from datapipe import curate  # noqa: E402
from scripts.bench_tokenize import train  # noqa: E402
from scripts.corpus import load_docs  # noqa: E402

# part -> (file suffix, function name) whose cumulative time is that part
PARTS = {
    "build_encoder": ("stages/tokenize.py", "__init__"),
    "prove_fast_encoder": ("stages/fast_bpe.py", "compile_bpe"),
    "read_block": ("datapipe/curation/blocks.py", "_read_block"),
    "view": ("datapipe/curation/blocks.py", "block_documents"),
    "to_pylist": (None, "'to_pylist'"),
    "verify": ("stages/tokenize.py", "_verify"),
    "encode_fast": ("stages/fast_bpe.py", "encode_batch"),
    "encode_tokenizers": ("stages/tokenize.py", "_encode_tokenizers"),
    "ids_to_arrow": ("stages/tokenize.py", "__call__"),
    "write": ("datapipe/core/workfiles.py", "write_work_table"),
}


def _phase_builder() -> Any:
    """The module whose `tokenize_phase` the run calls (datapipe.curation.steps; datapipe.curation.run before it)."""
    for name in ("datapipe.curation.steps", "datapipe.curation.run"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "tokenize_phase"):
            return module
    raise SystemExit("no module of datapipe.curation builds the tokenize phase")


def profile_run(jsonl: Path, out: Path, tokenizer: Path, encoder: str) -> dict[str, Any]:
    profiler = cProfile.Profile(time.process_time)
    task = tokenize_phase.tokenize_task

    def profiled_task(*args: Any) -> Any:
        profiler.enable()
        try:
            return task(*args)
        finally:
            profiler.disable()

    tokenize_phase.tokenize_task = profiled_task
    run_module = _phase_builder()
    build_phase = run_module.tokenize_phase

    def profiled_phase(*args: Any) -> Any:
        profiler.enable()
        try:
            return build_phase(*args)
        finally:
            profiler.disable()

    run_module.tokenize_phase = profiled_phase
    cfg = from_dict(CurateConfig, {
        "inputs": [{"path": str(jsonl), "domain_field": "domain"}], "filters": {},
        "dedup": {"exact": {"enabled": True}}, "tokenizer": {"path": str(tokenizer), "encoder": encoder},
        "output": {"dir": str(out), "shard_bytes": 32 * 2**20}})
    # each encoder builds its own stage, as a fresh worker does (`_tokenize_stage.cache_clear()` in the code before
    # the fast encoder's proof travelled with the phase, which `--baseline` runs may measure)
    stages = getattr(tokenize_phase, "_STAGE", None)
    stages.clear() if stages is not None else tokenize_phase._tokenize_stage.cache_clear()
    try:
        result = curate(cfg, executor=LocalExecutor(progress=False), progress=False, log=lambda _: None)
    finally:
        tokenize_phase.tokenize_task = task
        run_module.tokenize_phase = build_phase
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    parts = {}
    for part, (path, name) in PARTS.items():
        seconds = sum(row[3] for (file, _, func), row in stats.stats.items()
                      if ((func == name and file.endswith(path)) if path else name in func))
        parts[part] = round(seconds, 2)
    # the sample check encodes with tokenizers (inside `verify`); `__call__` holds the encoding and the texts
    in_verify = sum(timing[3] for (_, _, func), row in stats.stats.items() if func == "_encode_tokenizers"
                    for caller, timing in row[4].items() if caller[2] == "_verify")
    parts["encode_tokenizers_outside_verify"] = round(parts.pop("encode_tokenizers") - in_verify, 2)
    parts["ids_to_arrow"] = round(parts["ids_to_arrow"] - parts["to_pylist"] - parts["verify"] - parts["encode_fast"]
                                  - parts["encode_tokenizers_outside_verify"], 2)
    parts["read_block"], parts["view"] = parts["read_block"], round(parts["view"] - parts["read_block"], 2)
    return {"tokenize_cpu_s": round(total, 2), "parts_cpu_s": parts, "tokens": result.manifest["total_tokens"],
            "sha256": [s["sha256"] for s in result.manifest["shards"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--encoders", default="auto,tokenizers")
    args = parser.parse_args()
    docs = load_docs(args.corpus, args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="profile-tokenize-"))
    try:
        results: dict[str, Any] = {"docs": len(docs), "text_MB": round(sum(len(d["text"].encode()) for d in docs) / 1e6, 1)}
        if args.tokenizer:
            tokenizer = Path(args.tokenizer).resolve()
        else:
            tokenizer = tmp / "tokenizer.json"
            results["tokenizer"] = train(docs, tokenizer)
        jsonl = tmp / "input.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
        runs = {}
        for encoder in args.encoders.split(","):
            runs[encoder] = profile_run(jsonl, tmp / f"out-{encoder}", tokenizer, encoder)
            shutil.rmtree(tmp / f"out-{encoder}")
        results["identical_shards"] = len({tuple(r.pop("sha256")) for r in runs.values()}) == 1
        results["runs"] = runs
        if "auto" in runs and "tokenizers" in runs:
            results["tokenize_cpu_ratio_tokenizers_over_auto"] = round(
                runs["tokenizers"]["tokenize_cpu_s"] / runs["auto"]["tokenize_cpu_s"], 2)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
