"""Selection toward a target, pre-registered: what the model-based selectors buy, on fresh pools.

    python -m scripts.experiment_selection --out runs/selection --jobs 2        # about 45 minutes on 2 cores
    python -m scripts.analyze_selection runs/selection                           # the table, the interval, the picture

Everything below was fixed, and committed with `scripts/analyze_selection.py`, before the first cell trained.

- **Target**: Python code (the shared corpus's `code` domain, the standard library). Code documents whose seeded id
  hash falls in the lowest quarter form the target set, split by a second hash into the selectors' reference
  examples (`target/reference.jsonl.gz`) and the target eval set (`target/eval.jsonl.gz`, the first ~200 KB of text
  in hash order). No pool holds a target document, and every arm's curation removes the eval set's exact and near
  copies from its training data (`eval.source`, `decontaminate: near`).
- **Pools**: for each pool seed in POOL_SEEDS, a seeded sample of POOL_DOCS documents of the corpus without the
  target set. The seeds are fresh: the ablations so far drew pool seed 0, which stays out.
- **Arms**, each curated from the same pool by `datapipe curate` to the same budget of KEEP_TOKENS tokens, then
  trained with the same model, steps and seed (the pool seed):
    random      selection.method=random (the baseline)
    aa          random with another seed: the A/A arm, whose interval is the noise floor
    heuristic   the curation ablation's per-domain quality filters, then random to the budget
    classifier  the quality classifier, fit on the reference examples against the pool
    dsir        importance resampling toward the reference examples
    perplexity  the perplexity band under a bigram model of the reference examples
    junk        the known-answer control: the pool plus JUNK_DOCS documents of random letters (domain `junk`), then
                random to the budget. If junk is pure waste, the arm needs 1 / (1 - j) of random's compute, j being
                the junk share of its tokens (read from its manifest)
  Common to every arm: NFC normalization, exact dedup, the tokenizer trained once on a seeded sample of the corpus
  without the target set (`tokenizer/`).
- **Training**: the ~1.1 M-parameter GPT of the curation ablation, STEPS steps of 16 x 256 tokens, evaluated on the
  whole target eval set every EVAL_EVERY steps. The baseline's budget is B = STEPS / 1.5 (it trains to 1.5 B, so
  nothing is censored); the target is its eval loss at 0.75 B.
- **Endpoint and statistic**: see `scripts/analyze_selection.py`.

Rerunning the command skips finished curation and cells.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import xxhash
import yaml

CORPUS = "../shared/data/corpus.jsonl.gz"
TARGET_DOMAIN = "code"
TARGET_SHARE = 0.25  # of the target domain's documents: the target set
EVAL_TEXT_BYTES = 200_000  # the target eval set: its first documents in hash order up to this much text
SPLIT_SEED = 2026  # the id hashes that choose the target set and split it
POOL_SEEDS = [101, 102, 103, 104, 105, 106, 107, 108]
POOL_DOCS = 1200
KEEP_TOKENS = 500_000
JUNK_DOCS = 110
STEPS, BATCH, SEQ, EVAL_EVERY = 120, 16, 256, 15
ARMS = ["random", "aa", "heuristic", "classifier", "dsir", "perplexity", "junk"]
TRAIN_SET = ["model.n_layer=3", "model.n_head=4", "model.d_model=128", "model.max_seq_len=256", "optim.lr=3.0e-3",
             "train.ckpt_every=60", "data.eval_batches=0", "prefetch.enabled=false", "train.device=cpu"]
COMMON = ["normalize.enabled=true", "dedup.exact.enabled=true", "dedup.minhash.enabled=false", "filters={}",
          "diversity.enabled=false", "mixture.enabled=false", "eval.enabled=true", "eval.decontaminate=near",
          "read.block_bytes=auto", "output.shard_bytes=auto"]
RECIPE = "configs/ablation-curation.yaml"  # its inputs' domain field and its filters (the heuristic arm)


def _hash(doc_id: str, seed: int) -> float:
    return xxhash.xxh64_intdigest(doc_id.encode(), seed) / 2.0**64


def _write_jsonl(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wb") as f:
        f.writelines(lines)
    tmp.replace(path)


def split_corpus(out: Path, corpus: str) -> dict[str, int]:
    """target/reference, target/eval and rest (every other document) as gzipped JSONL, written once."""
    rest_path = out / "input" / "rest.jsonl.gz"
    if not rest_path.is_file():
        reference, evaluation, rest, eval_bytes = [], [], [], 0
        with gzip.open(corpus, "rb") as f:
            for line in f:
                doc = json.loads(line)
                if doc["source"] != TARGET_DOMAIN or _hash(doc["id"], SPLIT_SEED) >= TARGET_SHARE:
                    rest.append(line)
                elif _hash(doc["id"], SPLIT_SEED + 1) < 0.5:
                    reference.append(line)
                else:
                    evaluation.append((_hash(doc["id"], SPLIT_SEED + 2), line))
        chosen = []
        for _, line in sorted(evaluation):
            if eval_bytes >= EVAL_TEXT_BYTES:
                break
            chosen.append(line)
            eval_bytes += len(json.loads(line)["text"].encode())
        _write_jsonl(out / "target" / "reference.jsonl.gz", reference)
        _write_jsonl(out / "target" / "eval.jsonl.gz", chosen)
        _write_jsonl(rest_path, rest)
    count = {}
    for name in ("target/reference", "target/eval", "input/rest"):
        with gzip.open(out / f"{name}.jsonl.gz", "rb") as f:
            count[name] = sum(1 for _ in f)
    return count


def write_pool(out: Path, seed: int) -> Path:
    path = out / "pools" / str(seed) / "pool.jsonl.gz"
    if not path.is_file():
        with gzip.open(out / "input" / "rest.jsonl.gz", "rb") as f:
            lines = f.readlines()
        picked = sorted(random.Random(seed).sample(range(len(lines)), POOL_DOCS))
        _write_jsonl(path, [lines[i] for i in picked])
    return path


def write_junk_pool(out: Path, seed: int) -> Path:
    """The pool plus JUNK_DOCS documents of random lower-case 'words' (2-9 letters), ~6 KB each, domain `junk`."""
    path = out / "pools" / str(seed) / "pool-junk.jsonl.gz"
    if not path.is_file():
        rng = random.Random(seed + 10_000)
        with gzip.open(write_pool(out, seed), "rb") as f:
            lines = f.readlines()
        for i in range(JUNK_DOCS):
            words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(1000)]
            lines.append(json.dumps({"id": f"junk-{seed}-{i}", "text": " ".join(words), "source": "junk"}).encode() + b"\n")
        _write_jsonl(path, lines)
    return path


def curate(out: Path, folder: Path, inputs: str, sets: list[str]) -> dict:
    if not (folder / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "datapipe", "curate", RECIPE, "--output", str(folder), "--executor", "local",
               "--set", f"inputs=[{{path: {inputs}, domain_field: source}}]"] + [a for s in sets for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / "manifest.json").read_text())


def prepare(out: Path) -> tuple[Path, Path]:
    """The tokenizer (trained on a seeded sample of the rest) and the curated target eval set."""
    tokenizer_run = out / "tokenizer"
    sample = out / "input" / "tokenizer-sample.jsonl.gz"
    if not sample.is_file():
        with gzip.open(out / "input" / "rest.jsonl.gz", "rb") as f:
            lines = f.readlines()
        _write_jsonl(sample, [lines[i] for i in sorted(random.Random(0).sample(range(len(lines)), 3000))])
    curate(out, tokenizer_run, str(sample), ["eval.enabled=false", "dedup.exact.enabled=false", "dedup.minhash.enabled=false",
                                             "filters={}", "diversity.enabled=false", "mixture.enabled=false"])
    tokenizer = tokenizer_run / "tokenizer.json"
    target_eval = out / "target-eval"
    curate(out, target_eval, str(out / "target" / "eval.jsonl.gz"),
           ["eval.enabled=false", "dedup.exact.enabled=false", "dedup.minhash.enabled=false", "filters={}",
            "diversity.enabled=false", "mixture.enabled=false", f"tokenizer.path={tokenizer}"])
    return tokenizer, target_eval


def arm_sets(out: Path, arm: str, seed: int) -> list[str]:
    budget = [f"selection.keep_tokens={KEEP_TOKENS}", f"selection.seed={seed}"]
    reference = [f"selection.target={{path: {out / 'target' / 'reference.jsonl.gz'}}}"]
    recipe_filters = yaml.safe_load(Path(RECIPE).read_text())["filters"]
    return {
        "random": ["selection.method=random", *budget],
        "aa": ["selection.method=random", f"selection.keep_tokens={KEEP_TOKENS}", f"selection.seed={seed + 1000}"],
        "heuristic": [f"filters={json.dumps(recipe_filters)}", "selection.method=random", *budget],
        "classifier": ["selection.method=classifier", *reference, *budget],
        "dsir": ["selection.method=dsir", *reference, *budget],
        "perplexity": ["selection.method=perplexity", *reference, *budget],
        "junk": ["selection.method=random", *budget],
    }[arm]


def run_pool(out: Path, seed: int, tokenizer: Path, target_eval: Path) -> None:
    folder = out / "pools" / str(seed)
    pool, junk = write_pool(out, seed), write_junk_pool(out, seed)
    common = COMMON + [f"tokenizer.path={tokenizer}", f"eval.source={target_eval}"]
    for arm in ARMS:
        curate(out, folder / "data" / arm, str(junk if arm == "junk" else pool), common + arm_sets(out, arm, seed))
    spec = {"base": {"recipe": "configs/train-tiny.yaml", "set": TRAIN_SET, "data": str(folder / "data" / "random")},
            "arms": {arm: {"data": str(folder / "data" / arm)} for arm in ARMS}, "baseline": "random", "seeds": [seed],
            "budget": {"steps": STEPS, "batch_size": BATCH, "seq_len": SEQ, "eval_every": EVAL_EVERY},
            "eval_source": str(target_eval), "output": str(folder / "experiment")}
    (folder / "experiment.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    with open(folder / "experiment.log", "a") as log:
        subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(folder / "experiment.yaml")], check=True,
                       stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/selection")
    parser.add_argument("--corpus", default=CORPUS)
    parser.add_argument("--pools", type=int, nargs="+", default=POOL_SEEDS, help="pool seeds (the pre-registered ones by default)")
    parser.add_argument("--jobs", type=int, default=1, help="pools run at once, one process each")
    parser.add_argument("--pool", type=int, help=argparse.SUPPRESS)  # one pool, in a child process
    args = parser.parse_args(argv)
    out = Path(args.out)
    counts = split_corpus(out, args.corpus)
    tokenizer, target_eval = prepare(out)
    if args.pool is not None:
        run_pool(out, args.pool, tokenizer, target_eval)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending, running = list(args.pools), []
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            print(f"pool {seed}: started", file=sys.stderr, flush=True)
            running.append((seed, subprocess.Popen([sys.executable, "-m", "scripts.experiment_selection", "--out", str(out),
                                                    "--corpus", args.corpus, "--pool", str(seed)], env=env)))
        seed, proc = running.pop(0)
        if proc.wait():
            raise SystemExit(f"pool {seed} failed; see {out / 'pools' / str(seed)}")
        print(f"pool {seed}: done", file=sys.stderr, flush=True)
    print(json.dumps({"documents": counts, "pools": args.pools}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
