"""Benchmark tokenization: `tokenizers` against the fast encoder, side by side; prints JSON.

usage: python -m scripts.bench_tokenize [--corpus ../shared/data/corpus.jsonl.gz] [--docs N]
                                        [--tokenizer PATH] [--workers 1,2] [--skip-raw] [--skip-pipeline]
                                        [--skip-unicode]

In one run, on the same documents and the same tokenizer:
- the tokenizer: loaded from --tokenizer, or a byte-level BPE with a vocabulary of 32,000 trained
  with `stages.tokenize.train_tokenizer` on a deterministic 20 MB sample of the corpus (documents
  whose xxh64(id) falls below the sampling rate, as the runner samples);
- raw encoders, in N worker processes (each single-threaded, each with a static 1/N of the
  documents, started together): `tokenizers` `encode_batch`, `encode_batch_fast` (what the
  `tokenizers` path of datapipe calls), and the fast encoder alone; ids of every document are
  compared between `encode_batch` and the fast encoder;
- datapipe's whole tokenize-and-write stage: `datapipe.curation.run.curate` on an embedded Ray with N CPUs,
  filters off, exact dedup on, `tokenizer.encoder` 'tokenizers' and 'auto' (the default: the fast encoder); the
  `tokenize` + `shards` phase seconds, the tokenize phase's ratio (tokenizers over auto), and whether every run
  wrote shards with the same checksums;
- the regex engines' character classes over all 1,112,064 code points (`fast_bpe.regex_disagreements`).

MB/s per core = MB / wall seconds / N workers; for the raw encoders also MB per CPU second, which
other load on the machine disturbs less. Absolute figures depend on the (shared, noisy) machine;
compare within one run. The load average at the start and the end is recorded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from scripts.corpus import curate_in_fresh_process, load_docs
import xxhash

VOCAB = 32000
SAMPLE_BYTES = 20_000_000


def train(docs: list[dict], path: Path) -> dict:
    from stages.tokenize import TokenizerConfig, TokenizerTrainConfig, train_tokenizer

    total = sum(len(d["text"].encode()) for d in docs)
    rate = min(1.0, SAMPLE_BYTES / total)
    threshold = int(rate * 2**64)
    sample = [d["text"] for d in docs if rate >= 1.0 or xxhash.xxh64_intdigest(d["id"].encode()) < threshold]
    t0 = time.perf_counter()
    tok = train_tokenizer(sample, TokenizerConfig(train=TokenizerTrainConfig(vocab_size=VOCAB)))
    seconds = time.perf_counter() - t0
    tok.save(str(path))
    return {"vocab_size": VOCAB, "sample_docs": len(sample), "sample_MB": round(sum(len(t.encode()) for t in sample) / 1e6, 1),
            "train_seconds": round(seconds, 1)}


# ---------------------------------------------------------------- raw encoders, N processes


def _raw_worker(kind: str, corpus: str, limit: int | None, tokenizer: str, k: int, n: int, barrier, queue) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core per worker, as in datapipe's Ray workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    texts = [d["text"] for d in load_docs(corpus, limit)][k::n]
    tok_json = Path(tokenizer).read_text()
    if kind == "fast":
        from stages.fast_bpe import compile_bpe

        encode = compile_bpe(tok_json).encoder().encode_batch
    else:
        from stages.fast_bpe import reference_tokenizer

        tok = reference_tokenizer(tok_json)
        method = getattr(tok, kind)

        def encode(batch):
            return [e.ids for e in method(batch, add_special_tokens=False)]

    barrier.wait()
    t0, c0 = time.monotonic(), time.process_time()
    ids = []
    for i in range(0, len(texts), 512):
        ids.extend(encode(texts[i : i + 512]))
    t1, c1 = time.monotonic(), time.process_time()
    digests = [xxhash.xxh64_intdigest(np.asarray(x, dtype=np.uint32).tobytes()) for x in ids]
    queue.put((k, t0, t1, c1 - c0, sum(map(len, ids)), digests))


def raw_encode(kind: str, args: argparse.Namespace, tokenizer: Path, workers: int, n_bytes: int) -> tuple[dict, list[int]]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_raw_worker, args=(kind, args.corpus, args.docs, str(tokenizer), k, workers, barrier, queue))
             for k in range(workers)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    wall = max(r[2] for r in results) - min(r[1] for r in results)
    tokens = sum(r[4] for r in results)
    digests = [0] * sum(len(r[5]) for r in results)
    for k, *_, d in results:
        digests[k::workers] = d
    return {
        "seconds": round(wall, 2),
        "MB_per_s_per_core": round(n_bytes / wall / workers / 1e6, 2),
        "MB_per_s": round(n_bytes / wall / 1e6, 2),
        "Mtokens_per_s": round(tokens / wall / 1e6, 3),
        "cpu_seconds": round(sum(r[3] for r in results), 2),
        "MB_per_cpu_second": round(n_bytes / sum(r[3] for r in results) / 1e6, 2),
        "tokens": tokens,
    }, digests


# ---------------------------------------------------------------- the whole stage


def run_pipeline(jsonl: Path, out: Path, workers: int, tokenizer: Path, encoder: str) -> dict:
    cfg = {
        "inputs": [{"path": str(jsonl), "domain_field": "domain"}],
        "filters": {},
        "dedup": {"exact": {"enabled": True}},
        "tokenizer": {"path": str(tokenizer), "encoder": encoder},
        "output": {"dir": str(out), "shard_bytes": 32 * 2**20},
        "ray": {"num_cpus": workers},
    }
    result, stderr = curate_in_fresh_process(cfg)
    result["warnings"] = [line for line in stderr.splitlines() if "encoding with" in line or "fast encoder" in line][:5]
    return result


def written_bytes(out: Path, text_bytes: dict[str, int]) -> int:
    """Text bytes of the documents in the shards (the tokenize stage's input)."""
    total = 0
    for shard in sorted((out / "shards").glob("*.arrow")):
        with pa.memory_map(str(shard)) as source:
            ids = pa.ipc.open_file(source).read_all().column("id").to_pylist()
        total += sum(text_bytes[i] for i in ids)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--docs", type=int, default=None, help="use the first N documents (default: all)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: train one, vocab 32000, 20 MB sample)")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--skip-raw", action="store_true", help="skip the raw encoders (and their ids' comparison)")
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--skip-unicode", action="store_true")
    args = p.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    docs = load_docs(args.corpus, args.docs)
    text_bytes = {d["id"]: len(d["text"].encode()) for d in docs}
    n_bytes = sum(text_bytes.values())
    results: dict = {"docs": len(docs), "text_MB": round(n_bytes / 1e6, 1), "cpus": os.cpu_count(),
                     "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        if args.tokenizer:
            tokenizer = Path(args.tokenizer).resolve()
            results["tokenizer"] = {"path": str(args.tokenizer)}
        else:
            tokenizer = tmp / "tokenizer.json"
            results["tokenizer"] = train(docs, tokenizer)

        from stages.fast_bpe import try_compile

        t0 = time.perf_counter()
        compiled, why = try_compile(tokenizer.read_text())
        results["compile"] = {"ok": compiled is not None, "reason": why, "seconds": round(time.perf_counter() - t0, 3)}

        raw: dict = {}
        digests: dict = {}
        for kind in () if args.skip_raw else ("encode_batch", "encode_batch_fast", "fast"):
            for w in workers:
                raw[f"{kind}_{w}_workers"], digests[kind] = raw_encode(kind, args, tokenizer, w, n_bytes)
        if not args.skip_raw:
            results["raw"] = raw
            same = [a == b for a, b in zip(digests["encode_batch"], digests["fast"])]
            first_bad = next((docs[i]["id"] for i, ok in enumerate(same) if not ok), None)
            results["identical_ids"] = {"docs": sum(same), "of": len(same), "first_differing_doc": first_bad}
            for w in workers:
                results["raw"][f"speedup_{w}_workers"] = round(raw[f"encode_batch_{w}_workers"]["seconds"] / raw[f"fast_{w}_workers"]["seconds"], 2)

        if not args.skip_pipeline:
            jsonl = tmp / "input.jsonl"
            jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
            runs = {}
            for encoder in ("tokenizers", "auto"):  # auto: what a recipe gets (the fast encoder, proven and sample-checked)
                for w in workers:
                    out = tmp / f"{encoder}-{w}"
                    r = run_pipeline(jsonl, out, w, tokenizer, encoder)
                    mb = written_bytes(out, text_bytes)
                    stage = r["phases"]["tokenize"] + r["phases"]["shards"]
                    runs[f"{encoder}_{w}_workers"] = {
                        "docs_written": r["docs"],
                        "tokens": r["tokens"],
                        "text_MB": round(mb / 1e6, 1),
                        "tokenize_s": r["phases"]["tokenize"],
                        "shards_s": r["phases"]["shards"],
                        "stage_MB_per_s_per_core": round(mb / stage / w / 1e6, 2),
                        "stage_Mtokens_per_s": round(r["tokens"] / stage / 1e6, 3),
                        "wall_s": round(r["seconds"], 1),
                        "phase_seconds": r["phases"],
                        "log": r["warnings"],
                        "sha256": r["sha256"],
                    }
                    shutil.rmtree(out, ignore_errors=True)
            shas = {tuple(r.pop("sha256")) for r in runs.values()}
            results["pipeline"] = runs
            for w in workers:  # the tokenize phase's wall with tokenizers over the one with the default encoder
                results[f"tokenize_phase_ratio_{w}_workers"] = round(
                    runs[f"tokenizers_{w}_workers"]["tokenize_s"] / runs[f"auto_{w}_workers"]["tokenize_s"], 2)
            results["pipeline_identical_shards"] = len(shas) == 1

        if not args.skip_unicode:
            from stages.fast_bpe import regex_disagreements

            t0 = time.perf_counter()
            diffs = regex_disagreements(range(0x110000))
            results["regex_classes_all_code_points"] = {
                "disagreements": {k: [hex(c) for c in v] for k, v in diffs.items()},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        import tiktoken
        import tokenizers

        results["versions"] = {"tokenizers": tokenizers.__version__, "tiktoken": tiktoken.__version__}
        results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
