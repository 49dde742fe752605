"""The curation ablation: what each curation step buys in training, measured by training (the FineWeb/DCLM way).

    python -m scripts.experiment_curation --out runs/ablation-curation            # ../shared/data, 5 arms x 3 seeds
    python -m scripts.experiment_curation --out runs/abl --input my.jsonl.gz --domain-field source --steps 300

1. Curates five arms of one corpus from one recipe (configs/ablation-curation.yaml: every component on), each turning
   components off with --set, cumulatively:
     raw      read + tokenize only (no normalization, dedup, filter, sampling or mixture); chooses the eval split
     exact    + Unicode/whitespace normalization and exact dedup
     near     + MinHash-LSH near dedup
     filters  + the recipe's per-domain quality filters
     full     + diversity sampling and mixture reweighting (the whole recipe)
   Every arm after `raw` holds out raw's eval split (`eval.source`) with raw's tokenizer: the same eval documents for
   every arm, and every exact or near copy of them removed from every arm's training data (the raw arm's own split
   decontaminates it: dedup is off there, decontamination is not).
2. Writes the split's clean part: the held-out documents that reach the eval split in the `filters` arm, i.e. that
   every filter keeps (and dedup does not remove) -> OUT/data/clean-eval.
3. Checks that no arm trains on an eval document (by id or identical tokens) and runs `datapipe experiment` over the
   arms (OUT/experiment.yaml, same steps, batch and sequence length per arm, baseline raw, the clean part as an extra
   eval set). Rerunning skips finished curation and finished cells.
Prints one JSON: per arm the documents and tokens it trains on, what decontamination removed, and the experiment's
summary (final eval loss on the whole split and its clean part, per domain; tokens to the raw arm's final loss).

The data-constrained regime (`--pool-docs N --eval-from DIR`): every arm curates the same seeded sample of N raw
documents (OUT/input/pool.jsonl.gz), so the arms differ only in what curation removed from one small pool, and
the budget (`--steps`) reads it several times: a duplicate is seen again each epoch. The eval split, its clean
part and the tokenizer are those of the full-corpus ablation in DIR (every arm, raw included, decontaminated
against that split), so the eval set is the same as the full regime's. The report gives each arm's epochs over
its own data.

    python -m scripts.experiment_curation --out runs/ablation-curation --curate-only
    python -m scripts.experiment_curation --out runs/ablation-pool --pool-docs 400 --eval-from runs/ablation-curation --steps 400

With `--pool-whole-clusters` the pool samples the full corpus's duplicate clusters (found by DIR's `near` arm) whole
instead of documents, so it keeps the corpus's duplicates (a document sample keeps both copies of a pair with
probability (N / documents)^2). `--jobs J` trains J cells at once (seeds split across processes).

    python -m scripts.experiment_curation --out runs/ablation-dups --pool-docs 150 --pool-whole-clusters \
        --eval-from runs/ablation-curation --steps 250 --evals 5 --seeds 0 1 2 3 4 --jobs 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash
import yaml

from datapipe.core import shards

OFF = ["normalize.enabled=false", "dedup.exact.enabled=false", "dedup.minhash.enabled=false", "filters={}",
       "diversity.enabled=false", "mixture.enabled=false"]
ARMS: dict[str, list[str]] = {  # cumulative: each arm turns on one more component of the recipe
    "raw": OFF,
    "exact": OFF[3:] + ["dedup.minhash.enabled=false"],
    "near": OFF[3:],
    "filters": OFF[4:],
    "full": [],
}
# The model and budget: a ~1.1 M-parameter GPT (3 layers, d_model 128, vocab 4096) trains ~2 M tokens per cell in
# about 3 minutes on one CPU core, so 5 arms x 3 seeds fit in about an hour. Override with --train-set.
TRAIN_SET = ["model.n_layer=3", "model.n_head=4", "model.d_model=128", "model.max_seq_len=256", "optim.lr=3.0e-3",
             "train.ckpt_every=100", "data.eval_batches=0", "prefetch.enabled=false", "train.device=cpu"]


def curate_arm(recipe: str, out: Path, arm: str, inputs: list[str], raw: Path, shared_eval: bool = False) -> dict:
    folder = out / "data" / arm
    if (folder / shards.MANIFEST_NAME).is_file():
        return json.loads((folder / "stats.json").read_text())
    sets = list(ARMS[arm]) + inputs
    if arm != "raw" or shared_eval:  # raw's eval split and tokenizer: one eval set and one vocabulary for every arm
        sets += [f"eval.source={raw / 'eval'}", f"tokenizer.path={raw / 'tokenizer.json'}"]
    cmd = [sys.executable, "-m", "datapipe", "curate", recipe, "--output", str(folder)] + [a for s in sets for a in ("--set", s)]
    print(f"curate {arm}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return json.loads((folder / "stats.json").read_text())


def _rows(folder: Path, columns: list[str] | None = None) -> pa.Table:
    manifest = shards.read_manifest(folder)
    tables = [shards.open_shard(folder, s["path"]) for s in manifest["shards"]]
    return pa.concat_tables([t.select(columns) if columns else t for t in tables])


def write_clean_eval(out: Path) -> dict:
    """OUT/data/clean-eval: the eval documents that reached the eval split of the `filters` arm (dropped there as
    stage eval_split, reason eval_duplicate: the document or an identical copy of it passed every filter and dedup)."""
    folder, raw_eval = out / "data" / "clean-eval", out / "data" / "raw" / "eval"
    dropped_files = sorted((out / "data" / "filters" / "dropped").glob("eval_split-*.parquet"))
    dropped = pa.concat_tables([pq.read_table(f, columns=["id", "reason", "kept_id"]) for f in dropped_files])
    # an eval document itself, or an identical copy of it (filters are functions of the text), reached the split
    reached = dropped.filter(pc.equal(dropped.column("reason"), "eval_duplicate")).column("kept_id")
    manifest = shards.read_manifest(raw_eval)
    docs = _rows(raw_eval)
    clean = docs.filter(pc.is_in(docs.column("id"), value_set=reached.unique()))
    if not (folder / shards.MANIFEST_NAME).is_file():
        info = shards.write_shard(folder, 0, clean)
        tokenizer = {**manifest["tokenizer"], "path": str((out / "data" / "raw" / "tokenizer.json").resolve())}
        clean_manifest = shards.build_manifest([info], tokenizer=tokenizer, config=manifest.get("config", {}),
                                               config_hash=manifest.get("config_hash", ""))
        clean_manifest["split"] = {"name": "clean-eval", "of": str(raw_eval), "rule": "eval documents every filter keeps"}
        shards.write_manifest(folder, clean_manifest)
    whole = {d: c["docs"] for d, c in manifest["domains"].items()}
    kept = shards.read_manifest(folder)["domains"]
    return {"whole_docs": whole, "clean_docs": {d: kept.get(d, {}).get("docs", 0) for d in whole}}


def _token_digests(table: pa.Table) -> list[bytes]:
    """xxh3-128 of each row's token bytes (every arm has raw's tokenizer, so the same token dtype)."""
    tokens = table.column("tokens").combine_chunks()
    values, offsets = tokens.values.to_numpy(), tokens.offsets.to_numpy()
    return [xxhash.xxh3_128_digest(values[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(tokens))]


def duplicate_clusters(folder: Path) -> dict[str, str]:
    """Document id -> its duplicate cluster in a curated folder that ran exact and near dedup: the near-duplicate
    clusters (near_duplicates/clusters/, a parquet part per order range), each exact copy joined to the cluster of the document it copied
    (dropped/, stage exact_dedup). Documents in no cluster are absent."""
    near = pq.read_table(folder / "near_duplicates" / "clusters", columns=["id", "cluster_id"])
    cluster = dict(zip(near.column("id").to_pylist(), near.column("cluster_id").to_pylist()))
    dropped = pa.concat_tables(pq.read_table(f, columns=["id", "stage", "kept_id"]) for f in sorted((folder / "dropped").glob("*.parquet")))
    exact = dropped.filter(pc.equal(dropped.column("stage"), "exact_dedup"))
    for copy, kept in zip(exact.column("id").to_pylist(), exact.column("kept_id").to_pylist()):
        cluster[copy] = cluster.setdefault(kept, kept)
    return cluster


def write_pool(recipe: str, corpus: str | None, docs: int, path: Path, seed: int = 0,
               clusters: dict[str, str] | None = None) -> int:
    """A seeded sample of `docs` lines of the corpus (`--input`, else the recipe's first input: a local JSONL
    file, gzipped or not) -> `path` (gzipped JSONL), written once; the number of lines. With `clusters` (id ->
    duplicate cluster) the unit of sampling is a cluster, each kept with probability docs / lines: the pool holds
    about `docs` documents and every duplicate cluster whole, so its duplicate share is the corpus's (a sample of
    documents keeps both copies of a pair with probability (docs / lines)^2, i.e. almost never)."""
    if not path.is_file():
        source = corpus or yaml.safe_load(Path(recipe).read_text())["inputs"][0]["path"]
        opener = gzip.open if str(source).endswith(".gz") else open
        with opener(source, "rb") as f:
            lines = [line for line in f if line.strip()]
        if clusters is None:
            picked = sorted(random.Random(seed).sample(range(len(lines)), min(docs, len(lines))))
        else:
            units = [clusters.get(i, i) for i in (json.loads(line)["id"] for line in lines)]
            rng, rate = random.Random(seed), docs / len(lines)
            chosen = {u for u in sorted(set(units)) if rng.random() < rate}
            picked = [i for i, u in enumerate(units) if u in chosen]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with gzip.open(tmp, "wb") as f:
            f.writelines(lines[i] for i in picked)
        tmp.replace(path)
    with gzip.open(path, "rb") as f:
        return sum(1 for _ in f)


def run_parts(out: Path, spec: dict[str, Any], name: str, jobs: int) -> None:
    """`datapipe experiment` over `spec`, its seeds split across `jobs` processes (logs in OUT/logs/)."""
    seeds = spec["seeds"]
    parts = [seeds[j::jobs] for j in range(min(jobs, len(seeds)))]
    threads = str(max(1, (os.cpu_count() or 1) // len(parts)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    procs = []
    for j, part in enumerate(parts):
        path = out / f"experiment-{name}-{j}.yaml"
        path.write_text(yaml.safe_dump({**spec, "seeds": part}, sort_keys=False))
        log = open(out / "logs" / f"{name}-{j}.log", "a")
        print(f"{name}: seeds {part} -> {out / 'logs' / f'{name}-{j}.log'}", file=sys.stderr, flush=True)
        procs.append((subprocess.Popen([sys.executable, "-m", "datapipe", "experiment", str(path)], stdout=log,
                                       stderr=subprocess.STDOUT, env=env), log))
    failed = []
    for j, (proc, log) in enumerate(procs):
        if proc.wait():
            failed.append(j)
        log.close()
    if failed:
        raise SystemExit(f"{name}: part(s) {failed} failed; see {out / 'logs'}")


def check_no_eval_in_training(out: Path, eval_folder: Path | None = None, arms: list[str] | None = None) -> dict[str, int]:
    """Per arm, the training documents that are an eval document by id or identical tokens: must be 0."""
    eval_docs = _rows(eval_folder or out / "data" / "raw" / "eval", ["id", "tokens"])
    ids = set(eval_docs.column("id").to_pylist())
    digests = set(_token_digests(eval_docs))
    found = {}
    for arm in arms or list(ARMS):
        train = _rows(out / "data" / arm, ["id", "tokens"])
        same_id = sum(i in ids for i in train.column("id").to_pylist())
        found[arm] = same_id + sum(d in digests for d in _token_digests(train))
    if any(found.values()):
        raise SystemExit(f"eval documents in training data: {found}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/ablation-curation.yaml", help="the full curation recipe")
    parser.add_argument("--input", help="your corpus (path, glob or URL); default: the recipe's inputs")
    parser.add_argument("--domain-field", default="source", help="the record field naming each document's domain")
    parser.add_argument("--out", default="runs/ablation-curation")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps of every cell")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-set", nargs="*", default=[], help="extra --set overrides of the training recipe")
    parser.add_argument("--curate-only", action="store_true")
    parser.add_argument("--pool-docs", type=int, default=None,
                        help="the data-constrained regime: every arm curates this seeded sample of the corpus's documents")
    parser.add_argument("--pool-whole-clusters", action="store_true",
                        help="with --pool-docs: sample whole duplicate clusters (those --eval-from's `near` arm found), "
                             "so the pool keeps the corpus's duplicates")
    parser.add_argument("--pool-seed", type=int, default=0,
                        help="with --pool-docs: the seed of the pool's sample (0 drew the pools published so far; draw "
                             "others to replicate over pools, as scripts/experiment_selection does)")
    parser.add_argument("--jobs", type=int, default=1, help="cells trained at once (processes, seeds split among them)")
    parser.add_argument("--eval-from", default=None,
                        help="with --pool-docs: the full-corpus ablation's folder, whose eval split, clean part and tokenizer every arm uses")
    parser.add_argument("--evals", type=int, default=10, help="evaluations per cell (eval_every = steps // evals)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        help="the arms to curate and train (raw, the baseline, always)")
    args = parser.parse_args(argv)
    arms = ["raw"] + [a for a in ARMS if a in args.arms and a != "raw"]
    out = Path(args.out)
    pool = args.pool_docs is not None
    if pool and not args.eval_from:
        parser.error("--pool-docs needs --eval-from (a full-corpus ablation's folder: its eval split and tokenizer)")
    raw = Path(args.eval_from) / "data" / "raw" if pool else out / "data" / "raw"
    corpus = args.input
    report: dict = {}
    if pool:
        corpus = str(out / "input" / "pool.jsonl.gz")
        clusters = duplicate_clusters(Path(args.eval_from) / "data" / "near") if args.pool_whole_clusters else None
        report["pool_docs"] = write_pool(args.recipe, args.input, args.pool_docs, Path(corpus), seed=args.pool_seed,
                                         clusters=clusters)
    inputs = ([f"inputs=[{{path: {corpus}, domain_field: {args.domain_field}}}]"] if corpus else [])
    t0 = time.perf_counter()
    curated = {arm: curate_arm(args.recipe, out, arm, inputs, raw, shared_eval=pool) for arm in arms}
    if not pool and "filters" not in curated:
        curated["filters"] = curate_arm(args.recipe, out, "filters", inputs, raw)  # it defines the split's clean part
    clean = None if pool else write_clean_eval(out)
    clean_folder = (Path(args.eval_from) if pool else out) / "data" / "clean-eval"
    contamination = check_no_eval_in_training(out, raw / "eval", list(curated))
    report |= {"curate_seconds": round(time.perf_counter() - t0, 1), "eval": clean, "eval_in_training": contamination,
               "arms": {arm: {"train": {k: shards.read_manifest(out / "data" / arm)[k] for k in ("total_docs", "total_tokens")},
                              "decontamination": s.get("eval", {}).get("removed_from_train")}
                        for arm, s in curated.items()}}
    tokens_trained = args.steps * args.batch_size * args.seq_len
    for arm, entry in report["arms"].items():  # how many times the budget reads the arm's own data
        entry["epochs"] = round(tokens_trained / max(entry["train"]["total_tokens"], 1), 2)
    if not args.curate_only:
        spec = {"base": {"recipe": "configs/train-tiny.yaml", "set": TRAIN_SET + list(args.train_set),
                         "data": str(out / "data" / "raw")},
                "arms": {arm: {"data": str(out / "data" / arm)} for arm in arms},
                "baseline": "raw", "seeds": args.seeds,
                "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                           "eval_every": max(args.steps // args.evals, 1)},
                "eval_source": str(raw / "eval"), "extra_evals": {"clean": str(clean_folder)},
                "output": str(out / "experiment")}
        (out / "experiment.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        if args.jobs > 1:  # the cells, seeds split across processes; the command below then reads them back
            run_parts(out, spec, "cells", args.jobs)
        subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(out / "experiment.yaml")], check=True, stdout=sys.stderr)
        results = json.loads((out / "experiment" / "results.json").read_text())
        report["experiment"] = {
            "target": results["target"],
            "arms": {arm: {"final": {name: {"loss": v["loss"]["mean"], "std": v["loss"]["std"],
                                            "domains": {d: round(x["mean"], 4) for d, x in v["domains"].items()}}
                                     for name, v in r["final_by_eval_set"].items()},
                           "tokens_to_target": r["tokens_to_target"], "ratio_to_raw": r["ratio_to_baseline"]}
                     for arm, r in results["arms"].items()}}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
