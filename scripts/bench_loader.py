"""Benchmark the streaming loader on the curated shared corpus; prints one JSON object.

usage: python -m scripts.bench_loader [--source CURATED_DIR] [--corpus ../shared/data/corpus.jsonl.gz]
                                      [--seq-lens 512,2048,8192] [--batches 1500]

Without --source, the corpus is first curated into a temporary folder with `datapipe curate` on an
embedded Ray (the quickstart recipe's filters, an 8,192-token BPE; about a minute).

Reports, side by side in one run:
- packing efficiency (real tokens / row slots) at each seq_len over one whole epoch, for the loader
  (best-fit decreasing, look-ahead 512) against padding every document (or chunk) to its own row and
  against concatenate-and-chunk (100% full but cuts documents: how many, and how many that fit);
- efficiency at seq_len 2048 for look-ahead 64, 512 and 2048; batches per epoch on each of 2 ranks;
- throughput in tokens/s (seq_len 2048, batch 8) with 0 and 2 DataLoader workers, the consumer
  doing nothing;
- resume: state size, time from a new loader + load_state_dict to the first batch (median of 5) on
  the corpus (0 and 2 workers) and on a synthetic 1,000-shard manifest, with the shards opened;
- shard verification (`verify=True`: size, sha256 and token ids checked when a shard is first opened)
  against the raw read rate: one epoch at seq_len 2048 with verify off, on with an empty cache (every
  shard hashed) and on with the cache warm (no re-hash). `--only verify` runs just this part, on the
  synthetic 1,000-shard folder unless --source is given (no curation: a short run).
- many small shards: `--only many_shards [--baseline DIR]` writes the same long-tailed
  documents (3 domains, median 665 tokens) once as ~3,000 shards of ~8 KiB and once as shards of
  ~8 MiB, and reports, per source, the raw Arrow read rate (every shard opened and its tokens read
  into numpy, in manifest order) and one whole epoch of the loader (seq_len 2048, batch 8, 0 workers,
  shards verified with the cache warm) in real tokens/s with its shard opens. With --baseline (a
  `git archive` copy of an older tree) the same epoch runs on that code too, in a subprocess with
  PYTHONPATH=DIR; repeats interleave and each figure is the median.
Absolute seconds depend on the machine; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import yaml

from datapipe.core import shards
from datapipe.loader import PackedLoader
from datapipe.loader.reader import Layout, Reader


def curate(corpus: Path, out: Path) -> None:
    filters = yaml.safe_load((Path(__file__).parents[1] / "configs" / "quickstart.yaml").read_text())["filters"]
    cfg = {
        "inputs": [{"path": str(corpus), "domain_field": "source"}],
        "read": {"block_bytes": 4 * 2**20},
        "filters": filters,
        "tokenizer": {"train": {"vocab_size": 8192, "sample_bytes": 8_000_000}},
        "output": {"dir": str(out), "shard_bytes": 8 * 2**20},
        "ray": {"num_cpus": os.cpu_count()},
    }
    path = out.parent / "curate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "datapipe", "curate", str(path)], check=True, stdout=subprocess.DEVNULL)


def doc_lengths(source: str) -> np.ndarray:
    """num_tokens of every document, indexed by the loader's global document id (manifest order)."""
    m = shards.read_manifest(source)
    return np.concatenate([shards.open_shard(source, s["path"]).column("num_tokens").to_numpy() for s in m["shards"]])


def loader_epoch(source: str, seq_len: int, lengths: np.ndarray, **kw) -> dict:
    loader = PackedLoader(source, seq_len=seq_len, batch_size=64, seed=0, epochs=1, **kw)
    segments = np.zeros(len(lengths), dtype=np.int64)
    for b in loader:
        cu = b["cu_seqlens"].numpy()
        first = b["doc_ids"].reshape(-1).numpy()[cu[:-1]]
        segments += np.bincount(first[first >= 0], minlength=len(lengths))
    st = loader.stats()
    split = segments > 1
    return {
        "efficiency": round(st["packing_efficiency"], 5),
        "docs_split": int(split.sum()),
        "docs_split_that_fit": int((split & (lengths <= seq_len)).sum()),
        "rows": st["rows"],
    }


def baselines(lengths: np.ndarray, seq_len: int) -> dict:
    order = np.random.default_rng(0).permutation(len(lengths))
    lens = lengths[order]
    total = int(lens.sum())
    rows_pad = int(np.ceil(lens / seq_len).sum())  # each document (or its chunks) padded to its own rows
    start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    end = start + lens - 1
    cut = (start // seq_len) != (end // seq_len)  # the document crosses a row boundary
    rows_cat = -(-total // seq_len)
    return {
        "pad_each_doc": {"efficiency": round(total / (rows_pad * seq_len), 5),
                         "docs_split": int((lens > seq_len).sum()), "docs_split_that_fit": 0},
        "concat_and_chunk": {"efficiency": round(total / (rows_cat * seq_len), 5), "docs_split": int(cut.sum()),
                             "docs_split_that_fit": int((cut & (lens <= seq_len)).sum())},
    }


def throughput(source: str, workers: int, batches: int) -> dict:
    t0 = time.perf_counter()
    loader = PackedLoader(source, seq_len=2048, batch_size=8, seed=0, epochs=None, num_workers=workers)
    n, tokens, t_first = 0, 0, None
    for b in loader:
        if t_first is None:
            t_first = time.perf_counter()
        tokens += int(b["input_ids"].numel())
        n += 1
        if n == batches:
            break
    dt = time.perf_counter() - t0
    steady = time.perf_counter() - t_first
    return {"batches": n, "tokens_per_s": round(tokens / dt), "tokens_per_s_after_first_batch":
            round(tokens * (n - 1) / n / steady), "first_batch_s": round(t_first - t0, 3)}


def resume(source: str, skip: int, workers: int) -> dict:
    kw = dict(seq_len=2048, batch_size=8, seed=0, epochs=None)
    first = PackedLoader(source, **kw)
    sizes = []
    for k, _ in enumerate(first):
        sizes.append(len(json.dumps(first.state_dict())))
        if k + 1 == skip:
            break
    state = json.loads(json.dumps(first.state_dict()))
    expected = next(iter(first))
    opened: list[str] = []
    real = shards.open_shard
    shards.open_shard = lambda src, rel: (opened.append(rel), real(src, rel))[1]  # count reads
    times = []
    try:
        for _ in range(5):  # the median of 5: the machine is shared and noisy
            opened.clear()
            t0 = time.perf_counter()
            loader = PackedLoader(source, num_workers=workers, **kw)
            loader.load_state_dict(state)
            got = next(iter(loader))
            times.append(time.perf_counter() - t0)
    finally:
        shards.open_shard = real
    same = all(bool((got[k] == expected[k]).all()) for k in got)
    out = {"seconds_to_first_batch": round(float(np.median(times)), 3), "identical_next_batch": same,
           "state_json_bytes": len(json.dumps(state)), "state_json_bytes_max_over_run": max(sizes),
           "state_json_bytes_mean_over_run": round(sum(sizes) / len(sizes))}
    if workers == 0:  # worker processes open shards out of sight of this counter
        out["shards_opened"] = len(set(opened))
    return out


def verify_cost(source: str, cache: Path, repeats: int = 3) -> dict:
    """Shard verification against the raw read rate.

    Tokens/s of one epoch (seq_len 2048, batch 8, 0 workers, every shard kept open so each is opened
    once) with verification off, on with an empty cache (each shard hashed when first opened) and on
    with the cache warm; and the time of one shard reopen (the LRU evicted it) with verification off
    and on (a stat: the pass is remembered in the process).
    """
    m = shards.read_manifest(source)
    n_shards = len(m["shards"])

    def epoch(verify: bool) -> float:
        t0 = time.perf_counter()
        loader = PackedLoader(source, seq_len=2048, batch_size=8, seed=0, epochs=1, verify=verify,
                              cache_shards=n_shards)
        tokens = sum(int(b["input_ids"].numel()) for b in loader)
        return tokens / (time.perf_counter() - t0)

    size = sum(int(s["bytes"]) for s in m["shards"])
    t0 = time.perf_counter()
    for s in m["shards"]:
        shards.file_sha256(Path(source) / s["path"])
    hash_s = time.perf_counter() - t0
    runs: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
    for k in range(repeats):  # interleaved, the median of each: the machine is shared and noisy
        runs["off"].append(epoch(False))
        os.environ["DATAPIPE_CACHE_DIR"] = str(cache / f"cold{k}")  # empty: every shard is hashed
        runs["cold"].append(epoch(True))
        runs["warm"].append(epoch(True))  # the markers of the cold run: nothing is hashed
    med = {k: float(np.median(v)) for k, v in runs.items()}
    reopen = {}
    for verify in (False, True):
        reader = Reader(source, Layout(m), cache_shards=1, verify=verify)
        opens = min(n_shards, 200)
        for s in range(opens):  # the first pass verifies (warm markers); time the second
            reader.lengths(s)
        t0 = time.perf_counter()
        for s in range(opens):
            reader.lengths(s)
        reopen["on" if verify else "off"] = round(1e6 * (time.perf_counter() - t0) / opens, 1)
    return {"shards": n_shards, "bytes": size, "sha256_MB_per_s": round(size / hash_s / 1e6),
            **{f"tokens_per_s_verify_{k}": round(v) for k, v in med.items()},
            "cold_cost_pct": round(100 * (med["off"] / med["cold"] - 1), 1),
            "warm_cost_pct": round(100 * (med["off"] / med["warm"] - 1), 1),
            "reopen_us_verify_off": reopen["off"], "reopen_us_verify_on": reopen["on"]}


def synthetic_1000(out: Path) -> None:
    rng = np.random.default_rng(0)
    infos = []
    g = 0
    for s in range(1000):
        n = 40
        lens = np.minimum(rng.lognormal(6.5, 1.0, size=n).astype(int) + 2, 20000)
        toks = [np.append(rng.integers(1, 8000, size=k - 1, dtype=np.uint16), np.uint16(0)) for k in lens]
        table = pa.table({"id": [f"d{g + i}" for i in range(n)], "domain": ["man" if s % 4 else "code"] * n,
                          "tokens": pa.array(toks, pa.list_(pa.uint16())), "num_tokens": pa.array(lens, pa.int64())})
        infos.append(shards.write_shard(out, s, table))
        g += n
    tok = {"eos_id": 0, "bos_id": None, "dtype": "uint16", "vocab_size": 8192, "path": None, "sha256": None}
    shards.write_manifest(out, shards.build_manifest(infos, tokenizer=tok, config={}, config_hash="bench"))


def write_many_shards(out: Path, shard_tokens: int, seed: int = 0, tokens: int = 17_000_000) -> None:
    """Curated-like shards of long-tailed documents: each domain's documents in input order, a new
    shard once the current one holds `shard_tokens` tokens (as `output.shard_bytes` does)."""
    from datapipe.testing.shards import write_fake_shards

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(665), 1.1, size=tokens // 1000).astype(np.int64) + 2, 60_000)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    domain = rng.choice(["man", "code", "license"], size=len(lengths), p=[0.67, 0.31, 0.02])
    pool = rng.integers(1, 8192, size=int(lengths.max()) + 1, dtype=np.uint16)
    specs: list[list[dict]] = []
    for d in ("code", "license", "man"):
        shard: list[dict] = []
        used = 0
        for g in np.flatnonzero(domain == d):
            n = int(lengths[g])
            shard.append({"id": f"d{g}", "domain": d, "tokens": np.append(pool[g % 97 : g % 97 + n - 1], 0)})
            used += n
            if used >= shard_tokens:
                specs.append(shard)
                shard, used = [], 0
        if shard:
            specs.append(shard)
    write_fake_shards(out, specs, vocab_size=8192, dtype="uint16")


def raw_read_rate(source: str) -> float:
    """Real tokens/s of reading every shard's tokens into numpy, shard after shard (no loader)."""
    m = shards.read_manifest(source)
    t0 = time.perf_counter()
    n = 0
    for s in m["shards"]:
        tokens = shards.open_shard(source, s["path"]).column("tokens").combine_chunks()
        n += len(tokens.values.to_numpy(zero_copy_only=False))
    return n / (time.perf_counter() - t0)


def loader_epoch_rate(source: str) -> dict:
    """One whole epoch (seq_len 2048, batch 8, 0 workers): real tokens/s and shard opens."""
    opens = 0
    real = shards.open_shard

    def counting(src: str, rel: str):
        nonlocal opens
        opens += 1
        return real(src, rel)

    shards.open_shard = counting
    try:
        t0 = time.perf_counter()
        loader = PackedLoader(source, seq_len=2048, batch_size=8, seed=0, epochs=1, num_workers=0)
        tokens = sum(int((b["doc_ids"] >= 0).sum()) for b in loader)
        return {"tokens_per_s": tokens / (time.perf_counter() - t0), "opens": opens, "tokens": tokens,
                "datapipe": str(Path(sys.modules["datapipe"].__file__).parent)}
    finally:
        shards.open_shard = real


def many_shards(tmp: Path, baseline: str | None, repeats: int = 3) -> dict:
    os.environ["DATAPIPE_CACHE_DIR"] = str(tmp / "cache")  # shared by both trees: the same pass stamps
    here = str(Path(__file__).resolve().parents[1])
    results: dict = {}
    for name, shard_tokens in (("8KiB_shards", 4096), ("8MiB_shards", 4 * 2**20)):
        source = tmp / name
        write_many_shards(source, shard_tokens)
        m = shards.read_manifest(source)
        # warm the verification cache (every shard hashed once, untimed), as in any later epoch
        for _ in PackedLoader(str(source), seq_len=2048, batch_size=8, epochs=1, cache_shards=m["num_shards"]):
            pass
        runs: dict[str, list[dict]] = {"raw": [], "after": [], "before": []}
        for _ in range(repeats):  # interleaved: the machine is shared and noisy
            runs["raw"].append({"tokens_per_s": raw_read_rate(str(source))})
            for label, tree in (("after", here), ("before", baseline)):
                if tree is None:
                    continue
                # run as a file, not -m from this tree, so that `datapipe` comes from PYTHONPATH=tree
                out = subprocess.run([sys.executable, __file__, "--epoch-rate", str(source)], cwd=tree,
                                     env={**os.environ, "PYTHONPATH": tree}, check=True,
                                     capture_output=True, text=True).stdout
                runs[label].append(json.loads(out))
        med = {k: float(np.median([r["tokens_per_s"] for r in v])) for k, v in runs.items() if v}
        results[name] = {
            "shards": m["num_shards"], "docs": m["total_docs"], "tokens": m["total_tokens"],
            "median_shard_bytes": int(np.median([s["bytes"] for s in m["shards"]])),
            "raw_arrow_tokens_per_s": round(med["raw"]),
            **{f"loader_{k}_tokens_per_s": round(med[k]) for k in ("before", "after") if k in med},
            **{f"loader_{k}_opens_per_epoch": runs[k][0]["opens"] for k in ("before", "after") if runs[k]},
            **{f"loader_{k}_vs_raw": round(med[k] / med["raw"], 3) for k in ("before", "after") if k in med},
        }
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=None, help="a curated output folder (default: curate --corpus first)")
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--seq-lens", default="512,2048,8192")
    p.add_argument("--batches", type=int, default=1500, help="batches timed for throughput")
    p.add_argument("--only", choices=["verify", "many_shards"], default=None, help="run one part only (see above)")
    p.add_argument("--baseline", default=None, help="many_shards: an older tree to compare (PYTHONPATH)")
    p.add_argument("--epoch-rate", default=None, help=argparse.SUPPRESS)  # many_shards' subprocess: one epoch
    args = p.parse_args()
    if args.epoch_rate:
        print(json.dumps(loader_epoch_rate(args.epoch_rate)))
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    if args.only == "many_shards":
        try:
            print(json.dumps({"cpus": os.cpu_count(), "many_shards": many_shards(tmp, args.baseline)}, indent=1))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if args.only == "verify":
        try:
            source = args.source
            if source is None:
                synthetic_1000(tmp / "synthetic")
                source = str(tmp / "synthetic")
            print(json.dumps({"cpus": os.cpu_count(), "verify": verify_cost(source, tmp / "cache")}, indent=1))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        source = args.source
        results: dict = {"cpus": os.cpu_count()}
        if source is None:
            t0 = time.perf_counter()
            curate(Path(args.corpus).resolve(), tmp / "curated")
            source = str(tmp / "curated")
            results["curate_seconds"] = round(time.perf_counter() - t0, 1)
        m = shards.read_manifest(source)
        results["corpus"] = {"shards": m["num_shards"], "docs": m["total_docs"], "tokens": m["total_tokens"],
                             "domains": {d: c["tokens"] for d, c in m["domains"].items()}}
        lengths = doc_lengths(source)
        results["packing"] = {}
        for s in [int(x) for x in args.seq_lens.split(",")]:
            t0 = time.perf_counter()
            bfd = loader_epoch(source, s, lengths)
            bfd["epoch_seconds"] = round(time.perf_counter() - t0, 2)
            results["packing"][str(s)] = {"datapipe_bfd": bfd, **baselines(lengths, s)}
        results["lookahead_at_2048"] = {
            str(la): loader_epoch(source, 2048, lengths, lookahead=la)["efficiency"] for la in (64, 512, 2048)}
        results["two_ranks_batches_per_epoch_2048x8"] = [
            sum(1 for _ in PackedLoader(source, seq_len=2048, batch_size=8, seed=0, rank=r, world_size=2))
            for r in range(2)]
        results["throughput_2048x8"] = {f"{w}_workers": throughput(source, w, args.batches) for w in (0, 2)}
        results["resume_corpus"] = {f"{w}_workers": resume(source, 1000, w) for w in (0, 2)}
        synth = tmp / "synthetic"
        synthetic_1000(synth)
        results["resume_1000_shards"] = resume(str(synth), 300, 0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            next(iter(PackedLoader(str(synth), seq_len=2048, batch_size=8, seed=0)))
            times.append(time.perf_counter() - t0)
        results["resume_1000_shards"]["fresh_start_to_first_batch_s"] = round(float(np.median(times)), 3)
        results["verify_corpus"] = verify_cost(source, tmp / "cache")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
