"""Selection inside a domain, against the mixture it implies: the second pre-registered selection experiment, repaired.

    python -m scripts.experiment_selection --out ../runs/selection-within --jobs 2   # pools in the background
    python -m scripts.analyze_selection --markdown                                  # every table, from benchmarks/

The first experiment (8 pools, the `code` target only) is this script at commit 086f64d; its results are in
BENCHMARKS.md. Its target was a whole domain, so a selector's gain could be a mixture shift alone. This one asks
whether a selector finds the documents of a slice of a domain better than random sampling at the selector's own
domain shares. Everything below, and `scripts/analyze_selection.py`, was committed before the first cell trained.

- **Corpus**: the shared corpus with the `man` domain's English pages only (9% of its bytes are other languages,
  which `langid` selects without examples), and every manual page's first and last non-empty line cut: they carry
  the page's section ("Library Functions Manual", "(3pm)", "System Manager's Manual"), the slice's label.
- **Targets** (TARGETS), each a rule on metadata the selectors never see (they get only example texts):
    man3   manual pages of section 3 (library calls), by `/man3` in the id: the **primary** target (PRIMARY);
    man8   manual pages of section 8 (administration): a second slice of `man`;
    code   the `code` domain (Python's standard library): a whole domain, the first experiment restated beside its
           mixture-matched control.
  Of a target's documents, those whose seeded id hash is below TARGET_SHARE form its target set. Its eval set is the
  set's documents in a second hash's order up to EVAL_TEXT_BYTES of text, skipping any document of more than a tenth
  of that; the rest of the set are its reference examples (what the classifier fits on), less any whose text is an
  exact or near copy (word 5-gram MinHash Jaccard >= NEAR_THRESHOLD) of an eval document of any target. The other
  documents of each target stay in the corpus, for the selectors to find.
- **One eval folder** (`eval/`): the union of the targets' eval sets, each document's domain its target's name, so
  every evaluation gives one loss per target (`eval_domains`); every arm is decontaminated against all of it
  (`eval.source`, near copies dropped). A **general eval set** (GENERAL_SHARE of every domain's other documents,
  GENERAL_TEXT_BYTES per domain under the same 10% rule, out of every pool by id) measures each cell's final model
  per domain (`extra_evals`): what selection costs elsewhere, and the diversity arm's question.
- **Pools**: seeded samples of POOL_DOCS documents of the corpus without the target sets and the general eval set;
  the first FIRST_POOLS seeds of POOL_SEEDS, then the count `scripts.analyze_selection.final_pool_count` gives from
  their A/A spread on the primary target (at most len(POOL_SEEDS)).
- **Arms**, per pool, each curated by `datapipe curate` (the ablation recipe: NFC, exact dedup, no filters) to
  KEEP_TOKENS, training reading less than one epoch of each:
    random          selection.method=random: the baseline;
    aa              random with another seed: the noise floor;
    diversity       diversity sampling at random's mixture (each domain KEEP_TOKENS times its share of the pool): does
                    diversity-driven sampling beat a random subset of the same size on the general eval?
    classifier_T    per target T, the n-gram logistic classifier fit on T's reference examples against the pool;
    mm_T            per target T, mixture-matched random: random sampling with each domain's budget the tokens
                    classifier_T kept of it (`selection.domain_tokens`, filled): what the classifier buys beyond the
                    mixture it implies.
  random, aa and diversity train once a pool and are read on every target's curve: 3 + 2 x 3 = 9 cells a pool.
- **Training**: the 1.1 M-parameter GPT of the first experiment, STEPS steps of BATCH x SEQ tokens, evaluated on the
  eval folder every EVAL_EVERY steps (the whole folder, per target), the general set once at the end.
- **Endpoint, checks and statistic**: `scripts/analyze_selection.py`.
- **Unit of work**: a pool. When its 9 cells are trained, its raw results (every curve, every arm's mixture, slice
  shares, selection cost, the checks' inputs) are written to RAW_DIR/pool-SEED.json, the file to commit; a pool with
  that file is not run again, so the experiment resumes from what is committed. The tokenizer is trained once and
  kept in TOKENIZER (committed), so every pool in every session uses the same one.
- **Stage 2** (only after stage 1's pools are done, designed then, before its cells): DSIR and fastText on man3 on the
  same pools, fastText's own training FLOPs counted.

Rerunning the command skips finished curation and cells; a failing pool stops the pools running beside it.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import xxhash
import yaml

ROOT = Path(__file__).resolve().parent.parent
CORPUS = str(ROOT.parent / "shared" / "data" / "corpus.jsonl.gz")
RAW_DIR = ROOT / "benchmarks" / "selection_within_domain"
TOKENIZER = ROOT / "tokenizers" / "selection-experiment" / "tokenizer.json"


def _man_section(doc: dict, section: str) -> bool:
    return doc["source"] == "man" and re.search(rf"/man{section}[^/]*/", doc["id"]) is not None


TARGETS: dict[str, Callable[[dict], bool]] = {
    "man3": lambda doc: _man_section(doc, "3"),
    "man8": lambda doc: _man_section(doc, "8"),
    "code": lambda doc: doc["source"] == "code",
}
PRIMARY = "man3"
TARGET_DOMAIN = {"man3": "man", "man8": "man", "code": "code"}
TARGET_SHARE = 0.3  # of a target's documents: its target set (eval set, then reference examples)
EVAL_TEXT_BYTES = 200_000  # a target's eval set; no document over a tenth of it
NEAR_THRESHOLD, NEAR_NGRAM, NEAR_PERM = 0.8, 5, 128  # a reference example this near an eval document is dropped
GENERAL_SHARE, GENERAL_TEXT_BYTES = 0.02, 150_000  # the general eval set: per domain
SPLIT_SEED = 2028  # the id hashes that choose the held-out sets (the first experiment used 2026, the design 2027)
FIRST_POOLS = 16
POOL_SEEDS = list(range(301, 333))  # 32 fresh seeds: the first FIRST_POOLS, then the A/A rule's count
POOL_DOCS = 5000
STEPS, BATCH, SEQ, EVAL_EVERY = 400, 16, 256, 25
KEEP_TOKENS = 1_900_000  # 16% over the STEPS x BATCH x SEQ = 1,638,400 tokens training reads: under one epoch
SHARED_ARMS = ["random", "aa", "diversity"]
ARMS = SHARED_ARMS + [f"{kind}_{t}" for t in TARGETS for kind in ("classifier", "mm")]
TRAIN_SET = ["model.n_layer=3", "model.n_head=4", "model.d_model=128", "model.max_seq_len=256", "optim.lr=3.0e-3",
             "train.ckpt_every=100", "data.eval_batches=0", "prefetch.enabled=false", "train.device=cpu"]
COMMON = ["normalize.enabled=true", "dedup.exact.enabled=true", "dedup.minhash.enabled=false", "filters={}",
          "diversity.enabled=false", "mixture.enabled=false", "eval.enabled=true", "eval.decontaminate=near",
          "read.block_bytes=auto", "output.shard_bytes=auto"]
PLAIN = ["eval.enabled=false", "dedup.exact.enabled=false", "dedup.minhash.enabled=false", "filters={}",
         "diversity.enabled=false", "mixture.enabled=false"]
RECIPE = "configs/ablation-curation.yaml"  # its inputs' domain field, its tokenizer's settings


def _hash(doc_id: str, seed: int) -> float:
    return xxhash.xxh64_intdigest(doc_id.encode(), seed) / 2.0**64


def _write_jsonl(path: Path, docs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wb") as f:
        f.writelines(json.dumps(d, ensure_ascii=False).encode() + b"\n" for d in docs)
    tmp.replace(path)


def _read_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rb") as f:
        return [json.loads(line) for line in f]


def strip_frame(text: str) -> str:
    """A rendered manual page without its first and last non-empty lines (the header and footer naming its section)."""
    lines = text.split("\n")
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if len(filled) < 3:
        return ""
    return "\n".join(lines[filled[0] + 1:filled[-1]]).strip("\n")


def corpus_documents(corpus: str) -> list[dict]:
    """The corpus as the experiment sees it: English manual pages without their frame, the other domains as they are."""
    docs = []
    with gzip.open(corpus, "rb") as f:
        for line in f:
            doc = json.loads(line)
            if doc["source"] == "man":
                if doc.get("lang") != "en":
                    continue
                doc = {**doc, "text": strip_frame(doc["text"])}
                if not doc["text"]:
                    continue
            docs.append(doc)
    return docs


def balanced(candidates: list[tuple[float, dict]], text_bytes: int) -> list[dict]:
    """Candidates in hash order up to `text_bytes` of text, skipping any document over a tenth of it."""
    chosen, total = [], 0
    for _, doc in sorted(candidates, key=lambda c: c[0]):
        size = len(doc["text"].encode())
        if size > text_bytes // 10:
            continue
        if total >= text_bytes:
            break
        chosen.append(doc)
        total += size
    return chosen


def _minhash(text: str):
    from datasketch import MinHash

    words = text.split()
    grams = {" ".join(words[i:i + NEAR_NGRAM]) for i in range(max(1, len(words) - NEAR_NGRAM + 1))}
    m = MinHash(num_perm=NEAR_PERM, seed=SPLIT_SEED)
    m.update_batch([g.encode() for g in grams])
    return m


def without_copies(reference: list[dict], evals: list[dict]) -> tuple[list[dict], int]:
    """The reference examples that are neither an exact copy (same whitespace-normalised text) nor a near copy of an
    eval document, and how many were dropped."""
    from datasketch import MinHashLSH

    def key(text: str) -> str:
        return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()

    exact = {key(d["text"]) for d in evals}
    lsh = MinHashLSH(threshold=NEAR_THRESHOLD, num_perm=NEAR_PERM)
    for i, doc in enumerate(evals):
        lsh.insert(str(i), _minhash(doc["text"]))
    kept = [d for d in reference if key(d["text"]) not in exact and not lsh.query(_minhash(d["text"]))]
    return kept, len(reference) - len(kept)


def split_corpus(out: Path, corpus: str) -> dict[str, Any]:
    """The one eval file (every target's eval set, domain = the target), each target's reference file, the general
    eval file and the rest, as gzipped JSONL, written once; their document counts."""
    counts_path = out / "input" / "counts.json"
    if not counts_path.is_file():
        target_sets: dict[str, list[tuple[float, dict]]] = {t: [] for t in TARGETS}
        general: dict[str, list[tuple[float, dict]]] = {}
        rest = []
        for doc in corpus_documents(corpus):
            target = next((t for t, rule in TARGETS.items() if rule(doc)), None)
            if target is not None and _hash(doc["id"], SPLIT_SEED) < TARGET_SHARE:
                target_sets[target].append((_hash(doc["id"], SPLIT_SEED + 1), doc))
            elif _hash(doc["id"], SPLIT_SEED + 3) < GENERAL_SHARE:
                general.setdefault(doc["source"], []).append((_hash(doc["id"], SPLIT_SEED + 4), doc))
            else:
                rest.append(doc)
        evals = {t: balanced(docs, EVAL_TEXT_BYTES) for t, docs in target_sets.items()}
        all_evals = [d for t in TARGETS for d in evals[t]]
        counts: dict[str, Any] = {"eval": {}, "reference": {}, "reference_copies_dropped": {}}
        for t in TARGETS:
            chosen = {d["id"] for d in evals[t]}
            reference, dropped = without_copies([d for _, d in sorted(target_sets[t], key=lambda c: c[0])
                                                 if d["id"] not in chosen], all_evals)
            _write_jsonl(out / "target" / t / "reference.jsonl.gz", reference)
            counts["eval"][t], counts["reference"][t], counts["reference_copies_dropped"][t] = len(evals[t]), len(reference), dropped
        _write_jsonl(out / "input" / "eval.jsonl.gz", [{**d, "source": t} for t in TARGETS for d in evals[t]])
        general_docs = [d for domain in sorted(general) for d in balanced(general[domain], GENERAL_TEXT_BYTES)]
        _write_jsonl(out / "input" / "general.jsonl.gz", general_docs)
        _write_jsonl(out / "input" / "rest.jsonl.gz", rest)
        counts.update(general=len(general_docs), rest=len(rest))
        counts_path.write_text(json.dumps(counts, indent=1))
    return json.loads(counts_path.read_text())


def write_pool(out: Path, seed: int) -> Path:
    path = out / "pools" / str(seed) / "pool.jsonl.gz"
    if not path.is_file():
        docs = _read_jsonl(out / "input" / "rest.jsonl.gz")
        _write_jsonl(path, [docs[i] for i in sorted(random.Random(seed).sample(range(len(docs)), POOL_DOCS))])
    return path


def curate(folder: Path, inputs: Path, sets: list[str]) -> dict:
    if not (folder / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "datapipe", "curate", str(ROOT / RECIPE), "--output", str(folder), "--executor",
               "local", "--set", f"inputs=[{{path: {inputs}, domain_field: source}}]"] + [a for s in sets for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads((folder / "manifest.json").read_text())


def prepare(out: Path) -> tuple[Path, Path, Path]:
    """The tokenizer (TOKENIZER, trained once on a seeded sample of the rest), the eval folder, the general folder."""
    if not TOKENIZER.is_file():
        sample = out / "input" / "tokenizer-sample.jsonl.gz"
        docs = _read_jsonl(out / "input" / "rest.jsonl.gz")
        _write_jsonl(sample, [docs[i] for i in sorted(random.Random(0).sample(range(len(docs)), 3000))])
        curate(out / "tokenizer", sample, PLAIN)
        TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
        TOKENIZER.write_bytes((out / "tokenizer" / "tokenizer.json").read_bytes())
    plain = PLAIN + [f"tokenizer.path={TOKENIZER}"]
    curate(out / "eval", out / "input" / "eval.jsonl.gz", plain)
    curate(out / "general", out / "input" / "general.jsonl.gz", plain)
    return TOKENIZER, out / "eval", out / "general"


def domain_tokens(manifest: dict) -> dict[str, int]:
    return {d: int(v["tokens"]) for d, v in manifest["domains"].items() if int(v["tokens"]) > 0}


def arm_sets(arm: str, out: Path, seed: int, pool_tokens: dict[str, int], data: dict[str, Path]) -> list[str]:
    """One arm's curation settings (an mm_T arm's from classifier_T's curated folder, so after it)."""
    budget = [f"selection.keep_tokens={KEEP_TOKENS}"]
    if arm in ("random", "aa"):
        return ["selection.method=random", *budget, f"selection.seed={seed + (1000 if arm == 'aa' else 0)}"]
    if arm == "diversity":
        total = sum(pool_tokens.values())
        return ["diversity.enabled=true", f"diversity.seed={seed}",
                f"diversity.domains={json.dumps({d: round(KEEP_TOKENS * n / total) for d, n in pool_tokens.items()})}"]
    kind, target = arm.split("_", 1)
    if kind == "classifier":
        return ["selection.method=classifier", f"selection.target={{path: {out / 'target' / target / 'reference.jsonl.gz'}}}",
                *budget, f"selection.seed={seed}"]
    kept = domain_tokens(json.loads((data[f"classifier_{target}"] / "manifest.json").read_text()))
    return ["selection.method=random", f"selection.domain_tokens={json.dumps(kept)}", f"selection.seed={seed}"]


def run_pool(out: Path, seed: int, tokenizer: Path, evals: Path, general: Path) -> Path:
    """Curate and train one pool's arms, then write its raw results (RAW_DIR/pool-SEED.json)."""
    pool, folder = write_pool(out, seed), out / "pools" / str(seed)
    common = COMMON + [f"tokenizer.path={tokenizer}", f"eval.source={evals}"]
    pool_tokens = domain_tokens(curate(folder / "pool", pool, common))  # after normalization, dedup, decontamination
    data: dict[str, Path] = {}
    for arm in ARMS:  # classifier_T before mm_T
        data[arm] = folder / "data" / arm
        curate(data[arm], pool, common + arm_sets(arm, out, seed, pool_tokens, data))
    spec = {"base": {"recipe": str(ROOT / "configs" / "train-tiny.yaml"), "set": TRAIN_SET, "data": str(data["random"])},
            "arms": {arm: {"data": str(data[arm])} for arm in ARMS}, "baseline": "random", "seeds": [seed],
            "budget": {"steps": STEPS, "batch_size": BATCH, "seq_len": SEQ, "eval_every": EVAL_EVERY},
            "eval_source": str(evals), "extra_evals": {"general": str(general)}, "output": str(folder / "experiment")}
    (folder / "experiment.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with open(folder / "experiment.log", "a") as log:
        subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(folder / "experiment.yaml")], check=True,
                       stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    raw = pool_record(folder, seed, data, evals, tokenizer)
    path = RAW_DIR / f"pool-{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(raw, indent=1, sort_keys=True) + "\n")
    path.with_suffix(".tmp").replace(path)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unigram_entropy(evals: Path) -> dict[str, float]:
    """Per eval domain (a target), the entropy in nats a token of its tokens under their own frequencies: the loss of
    a model that knows only the slice's token frequencies, exactly."""
    import numpy as np

    from datapipe.core import shards

    counts: dict[str, Any] = {}
    for shard in shards.read_manifest(evals)["shards"]:
        table = shards.open_shard(evals, shard["path"])
        for domain, tokens in zip(table.column("domain").to_pylist(), table.column("tokens").to_pylist()):
            found = np.bincount(np.asarray(tokens, np.int64))
            total = counts.get(domain, np.zeros(0, np.int64))
            size = max(len(total), len(found))
            counts[domain] = np.pad(total, (0, size - len(total))) + np.pad(found, (0, size - len(found)))
    out = {}
    for domain, c in counts.items():
        p = c[c > 0] / c.sum()
        out[domain] = float(-(p * np.log(p)).sum())
    return out


def kept_documents(data: Path) -> dict[str, Any]:
    """A curated folder's training tokens per domain and per target slice (by each target's rule on the id)."""
    from datapipe.core import shards

    by_domain: dict[str, int] = {}
    by_slice = {t: 0 for t in TARGETS}
    for shard in shards.read_manifest(data)["shards"]:
        table = shards.open_shard(data, shard["path"])
        lengths = table.column("tokens").combine_chunks().value_lengths().to_pylist()
        for doc_id, domain, n in zip(table.column("id").to_pylist(), table.column("domain").to_pylist(), lengths):
            by_domain[domain] = by_domain.get(domain, 0) + n
            for t, rule in TARGETS.items():
                by_slice[t] += n if rule({"id": doc_id, "source": domain}) else 0
    return {"tokens": sum(by_domain.values()), "domain_tokens": dict(sorted(by_domain.items())), "slice_tokens": by_slice}


def arm_record(cell: Path, data: Path) -> dict[str, Any]:
    """One arm's raw results: per target its eval curve, the general set's final losses, what it kept and cost."""
    from datapipe.train.experiment import cell_compute, eval_curve

    extra = cell / "extra_evals.json"
    if not extra.is_file():
        raise SystemExit(f"{extra} is missing: the cell's final model was not evaluated on the general set; rerun the pool")
    general = next((v for k, v in json.loads(extra.read_text()).items() if k.startswith("general=")), None)
    if general is None:
        raise SystemExit(f"{extra} has no evaluation of the general set; rerun the pool")
    manifest = json.loads((data / "manifest.json").read_text())
    stats = json.loads((data / "stats.json").read_text())
    selection = manifest.get("model_selection") or {}
    return {
        "curves": {t: [list(p) for p in eval_curve(cell, EVAL_EVERY, STEPS, domain=t)] for t in TARGETS},
        "curve_overall": [list(p) for p in eval_curve(cell, EVAL_EVERY, STEPS)],
        "general_loss": {d: float(v["loss"]) for d, v in general.get("eval_domains", {}).items() if v.get("loss") is not None},
        "tokens_trained": cell_compute(cell)["tokens_trained"],
        "kept": kept_documents(data),
        "selection": {"flops": float(selection.get("flops") or 0.0), "cpu_seconds": float(selection.get("cpu_seconds") or 0.0),
                      "groups": (stats.get("model_selection") or {}).get("groups", {})},
        "budgets": arm_budgets(manifest),
    }


def arm_budgets(manifest: dict) -> dict[str, float]:
    """The token budget the arm's curation was given, per group ('*': the whole corpus), as its manifest's config
    snapshot records it."""
    selection, diversity = manifest["config"]["selection"], manifest["config"]["diversity"]
    if diversity.get("enabled"):
        return {d: float(b) for d, b in diversity["domains"].items()}
    if selection.get("domain_tokens"):
        return {d: float(b) for d, b in selection["domain_tokens"].items()}
    return {"*": float(selection["keep_tokens"])}


def pool_record(folder: Path, seed: int, data: dict[str, Path], evals: Path, tokenizer: Path) -> dict[str, Any]:
    """A finished pool's raw results, everything the analysis reads."""
    cells = folder / "experiment" / "cells"
    return {"seed": seed, "tokenizer_sha256": _sha256(tokenizer),
            "eval_sha256": [s["sha256"] for s in json.loads((evals / "manifest.json").read_text())["shards"]],
            "design": {"steps": STEPS, "batch": BATCH, "seq": SEQ, "eval_every": EVAL_EVERY, "keep_tokens": KEEP_TOKENS,
                       "pool_docs": POOL_DOCS, "split_seed": SPLIT_SEED},
            "pool": kept_documents(folder / "pool"), "unigram_entropy": unigram_entropy(evals),
            "arms": {arm: arm_record(cells / arm / f"seed-{seed}", data[arm]) for arm in ARMS}}


def run_pools(seeds: list[int], jobs: int, child: Callable[[int], subprocess.Popen], poll_s: float = 2.0) -> None:
    """Run each pool in a child process, `jobs` at once; when one fails, stop the others and exit naming it (a rerun
    then never trains a cell twice at once)."""
    pending, running = list(seeds), {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                seed = pending.pop(0)
                print(f"pool {seed}: started", file=sys.stderr, flush=True)
                running[seed] = child(seed)
            for seed, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[seed]
                if code:
                    raise SystemExit(f"pool {seed} failed (exit {code}); the pools beside it were stopped: "
                                     f"{sorted(running) or 'none'}; rerun to go on")
                print(f"pool {seed}: done", file=sys.stderr, flush=True)
            time.sleep(poll_s)
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="../runs/selection-within")
    parser.add_argument("--corpus", default=CORPUS)
    parser.add_argument("--pools", type=int, nargs="+", default=POOL_SEEDS[:FIRST_POOLS],
                        help="pool seeds (stage 1's by default; then the next ones of POOL_SEEDS, as the A/A rule says)")
    parser.add_argument("--jobs", type=int, default=1, help="pools run at once, one process each")
    parser.add_argument("--pool", type=int, help=argparse.SUPPRESS)  # one pool, in a child process
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    counts = split_corpus(out, args.corpus)
    tokenizer, evals, general = prepare(out)
    if args.pool is not None:
        print(run_pool(out, args.pool, tokenizer, evals, general))
        return 0
    todo = [s for s in args.pools if not (RAW_DIR / f"pool-{s}.json").is_file()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    run_pools(todo, args.jobs, lambda seed: subprocess.Popen(
        [sys.executable, "-m", "scripts.experiment_selection", "--out", str(out), "--corpus", args.corpus,
         "--pool", str(seed)], env=env, cwd=ROOT))
    print(json.dumps({"documents": counts, "pools": args.pools, "ran": todo}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
