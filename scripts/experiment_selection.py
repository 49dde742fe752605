"""Selection toward a target, second pre-registered experiment: selectors against the mixture they imply.

    python -m scripts.selection_power                                      # the pool count, from the measured A/A spread
    python -m scripts.experiment_selection --out runs/selection2 --jobs 8  # ~1,500 cells of 600 steps: not a 2-core job
    python -m scripts.analyze_selection runs/selection2 --markdown        # the tables, every figure from the run's files

The first experiment (8 pools, the `code` target only, 120 steps) is this script at commit 086f64d; its results are
in BENCHMARKS.md. Everything below was fixed, and committed with `scripts/analyze_selection.py` and
`scripts/selection_power.py`, before the first cell of this one trained.

- **Targets** (TARGETS), each a rule on metadata the selectors never see (they get only example texts):
    code   the corpus's `code` domain (Python's standard library): a whole domain, as in the first experiment;
    man8   manual pages of section 8 (system administration), by the `/man8` folder in the document's id: a slice
           of the `man` domain;
    man3   manual pages of section 3 (library calls), by `/man3` in the id: another slice of `man`.
  Of each target's documents, those whose seeded id hash falls in the lowest TARGET_SHARE form its target set, split
  by a second hash into reference examples (what the selectors are given) and eval candidates; the eval set is the
  candidates in hash order up to EVAL_TEXT_BYTES of text, skipping any document of more than a tenth of that (no
  document over 10% of the set: the first experiment's eval set had four files making 79% of its text). The rest of
  each target's documents stay in the corpus, for the selectors to find. A **general eval set** (GENERAL_SHARE of
  every domain's documents, GENERAL_TEXT_BYTES per domain under the same 10% rule) measures what selection costs on
  the other domains: each cell's final model is evaluated on it per domain (`extra_evals`).
- **Pools**: seeded samples of POOL_DOCS documents of the corpus without any target set or general eval document.
  Stage 1 runs the first FIRST_POOLS seeds of POOL_SEEDS; the A/A spread measured there on the three targets (the
  pooled sd of log(aa / random)) sets the final count, `scripts.selection_power.pools_needed(sd)`, at least
  FIRST_POOLS and at most len(POOL_SEEDS) (45: the count the first experiment's spread needs). Only random and aa
  cells enter that rule, so it cannot favour a selector.
- **Arms**, per pool and target, each curated by `datapipe curate` (the ablation recipe, no filters) to KEEP_TOKENS:
    random        selection.method=random: the baseline against plain sampling;
    aa            random with another seed: the noise floor;
    mixture       the mixture-reweighting stage aimed at the target's domain: explicit weights giving that domain
                  MIXTURE_TARGET_SHARE of the budget and the others their pool shares, max_epochs 1, no selector;
    classifier    the n-gram logistic classifier, fit on the reference examples against the pool;
    dsir          DSIR as the paper does it (chunk-length-normalised weights, Gumbel top-k);
    fasttext      a fastText classifier (DCLM's setup: word bigrams, `__label__hq` = the reference examples,
                  `__label__cc` = a seeded sample of the pool the size of the reference set) trained by this script
                  with the binding, applied through `selection.method=fasttext`;
    mm_<selector> mixture-matched random, one per selector above: random sampling at that selector arm's own realised
                  per-domain token shares in this pool (the mixture stage with those weights, max_epochs 1): what the
                  selector buys beyond the mixture it implies;
    diversity     the diversity-sampling stage at the same budget: each domain's token budget KEEP_TOKENS times its pool
                  share (random's mixture), k-means clusters as the stage chooses;
    junk          the known-answer control: the pool plus JUNK_DOCS documents of random letters (domain `junk`), then
                  random. Its expected cost, 1 / (1 - j) with j the junk share of the junk pool's tokens, is computed by
                  `scripts/analyze_selection.py` from the curated junk pool before selection (`pool-junk`).
  Common: NFC normalization, exact dedup, the target's eval set decontaminated (`eval.source`, near copies dropped),
  the tokenizer trained once on a seeded sample of the corpus without the held-out sets. The general eval documents
  are out of every pool by id (their near copies may stay: that set measures the other domains, not the target).
- **Training**: the 1.1 M-parameter GPT of the first experiment, STEPS steps of BATCH x SEQ tokens (2.46 M tokens:
  five times the first experiment, past the stage where the model learns token frequencies: the analysis reports
  each pool's random-arm loss against the target eval set's unigram cross-entropy under random's token counts, and
  flags pools where the target loss is not below it), evaluated on the target's eval set every EVAL_EVERY steps.
  Selection's cut is filled, so its arms hold at least KEEP_TOKENS; the diversity stage's cut stops before each
  cluster's crossing document and the mixture stage samples by hash, so those arms can fall a little short or over:
  KEEP_TOKENS is 14% over STEPS x BATCH x SEQ so that none repeats its data, and the analysis reports every arm's
  kept tokens and epochs.
- **Endpoint and statistic**: `scripts/analyze_selection.py` (target loss, comparisons, floors, censoring, decision).

Rerunning the command skips finished curation and cells.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import xxhash
import yaml

CORPUS = "../shared/data/corpus.jsonl.gz"
TARGETS: dict[str, Callable[[dict], bool]] = {
    "code": lambda doc: doc["source"] == "code",
    "man8": lambda doc: doc["source"] == "man" and re.search(r"/man8[^/]*/", doc["id"]) is not None,
    "man3": lambda doc: doc["source"] == "man" and re.search(r"/man3[^/]*/", doc["id"]) is not None,
}
TARGET_DOMAIN = {"code": "code", "man8": "man", "man3": "man"}
TARGET_SHARE = 0.25  # of a target's documents: its target set (reference examples and eval candidates)
EVAL_TEXT_BYTES = 300_000  # a target's eval set; no document over a tenth of it
GENERAL_SHARE, GENERAL_TEXT_BYTES = 0.02, 150_000  # the general eval set: per domain
SPLIT_SEED = 2027  # the id hashes that choose the held-out sets and split them (the first experiment used 2026)
FIRST_POOLS = 16
POOL_SEEDS = list(range(201, 246))  # 45 fresh seeds; stage 1 runs the first FIRST_POOLS
POOL_DOCS = 5000
KEEP_TOKENS = 2_800_000  # 14% over what training reads: the margin covers the diversity arm (see Training)
JUNK_DOCS = 400
MIXTURE_TARGET_SHARE = 0.5
STEPS, BATCH, SEQ, EVAL_EVERY = 600, 16, 256, 25
SELECTORS = ["classifier", "dsir", "fasttext"]
ARMS = ["random", "aa", "mixture", *SELECTORS, *(f"mm_{s}" for s in SELECTORS), "diversity", "junk"]
# DCLM's bigram classifier settings, with 200,000 hash buckets of 64 dimensions (51 MB a model) instead of fastText's
# 2 M of 100 (800 MB): 135 models, one per pool and target
FASTTEXT = {"dim": 64, "epoch": 5, "lr": 0.1, "wordNgrams": 2, "minCount": 1, "bucket": 200_000, "thread": 1}
TRAIN_SET = ["model.n_layer=3", "model.n_head=4", "model.d_model=128", "model.max_seq_len=256", "optim.lr=3.0e-3",
             "train.ckpt_every=100", "data.eval_batches=0", "prefetch.enabled=false", "train.device=cpu"]
COMMON = ["normalize.enabled=true", "dedup.exact.enabled=true", "dedup.minhash.enabled=false", "filters={}",
          "diversity.enabled=false", "mixture.enabled=false", "eval.enabled=true", "eval.decontaminate=near",
          "read.block_bytes=auto", "output.shard_bytes=auto"]
RECIPE = "configs/ablation-curation.yaml"  # its inputs' domain field


def _hash(doc_id: str, seed: int) -> float:
    return xxhash.xxh64_intdigest(doc_id.encode(), seed) / 2.0**64


def _write_jsonl(path: Path, lines: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wb") as f:
        f.writelines(lines)
    tmp.replace(path)


def _read_jsonl(path: Path) -> list[bytes]:
    with gzip.open(path, "rb") as f:
        return f.readlines()


def balanced(candidates: list[tuple[float, bytes]], text_bytes: int) -> list[bytes]:
    """Candidates in hash order up to `text_bytes` of text, skipping any document over a tenth of it."""
    chosen, total = [], 0
    for _, line in sorted(candidates):
        size = len(json.loads(line)["text"].encode())
        if size > text_bytes // 10:
            continue
        if total >= text_bytes:
            break
        chosen.append(line)
        total += size
    return chosen


def split_corpus(out: Path, corpus: str) -> dict[str, int]:
    """Per target its reference and eval files, the general eval file and the rest, as gzipped JSONL, written once."""
    rest_path = out / "input" / "rest.jsonl.gz"
    if not rest_path.is_file():
        reference = {t: [] for t in TARGETS}
        candidates: dict[str, list[tuple[float, bytes]]] = {t: [] for t in TARGETS}
        general: dict[str, list[tuple[float, bytes]]] = {}
        rest = []
        with gzip.open(corpus, "rb") as f:
            for line in f:
                doc = json.loads(line)
                target = next((t for t, rule in TARGETS.items() if rule(doc)), None)
                if target is not None and _hash(doc["id"], SPLIT_SEED) < TARGET_SHARE:
                    if _hash(doc["id"], SPLIT_SEED + 1) < 0.5:
                        reference[target].append(line)
                    else:
                        candidates[target].append((_hash(doc["id"], SPLIT_SEED + 2), line))
                elif _hash(doc["id"], SPLIT_SEED + 3) < GENERAL_SHARE:
                    general.setdefault(doc["source"], []).append((_hash(doc["id"], SPLIT_SEED + 4), line))
                else:
                    rest.append(line)
        for target in TARGETS:
            _write_jsonl(out / "target" / target / "reference.jsonl.gz", reference[target])
            _write_jsonl(out / "target" / target / "eval.jsonl.gz", balanced(candidates[target], EVAL_TEXT_BYTES))
        _write_jsonl(out / "general" / "eval.jsonl.gz", [line for d in sorted(general) for line in balanced(general[d], GENERAL_TEXT_BYTES)])
        _write_jsonl(rest_path, rest)
    names = [f"target/{t}/{part}" for t in TARGETS for part in ("reference", "eval")] + ["general/eval", "input/rest"]
    return {name: len(_read_jsonl(out / f"{name}.jsonl.gz")) for name in names}


def write_pool(out: Path, seed: int) -> Path:
    path = out / "pools" / str(seed) / "pool.jsonl.gz"
    if not path.is_file():
        lines = _read_jsonl(out / "input" / "rest.jsonl.gz")
        _write_jsonl(path, [lines[i] for i in sorted(random.Random(seed).sample(range(len(lines)), POOL_DOCS))])
    return path


def write_junk_pool(out: Path, seed: int) -> Path:
    """The pool plus JUNK_DOCS documents of random lower-case 'words' (2-9 letters), ~6 KB each, domain `junk`."""
    path = out / "pools" / str(seed) / "pool-junk.jsonl.gz"
    if not path.is_file():
        rng = random.Random(seed + 10_000)
        lines = _read_jsonl(write_pool(out, seed))
        for i in range(JUNK_DOCS):
            words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(1000)]
            lines.append(json.dumps({"id": f"junk-{seed}-{i}", "text": " ".join(words), "source": "junk"}).encode() + b"\n")
        _write_jsonl(path, lines)
    return path


def curate(folder: Path, inputs: str, sets: list[str]) -> dict:
    if not (folder / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "datapipe", "curate", RECIPE, "--output", str(folder), "--executor", "local",
               "--set", f"inputs=[{{path: {inputs}, domain_field: source}}]"] + [a for s in sets for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((folder / "manifest.json").read_text())


PLAIN = ["eval.enabled=false", "dedup.exact.enabled=false", "dedup.minhash.enabled=false", "filters={}",
         "diversity.enabled=false", "mixture.enabled=false"]


def prepare(out: Path) -> tuple[Path, dict[str, Path], Path]:
    """The tokenizer (trained on a seeded sample of the rest), each target's curated eval set, the general eval set."""
    sample = out / "input" / "tokenizer-sample.jsonl.gz"
    if not sample.is_file():
        lines = _read_jsonl(out / "input" / "rest.jsonl.gz")
        _write_jsonl(sample, [lines[i] for i in sorted(random.Random(0).sample(range(len(lines)), 3000))])
    curate(out / "tokenizer", str(sample), PLAIN)
    tokenizer = out / "tokenizer" / "tokenizer.json"
    evals = {t: out / "target" / t / "eval" for t in TARGETS}
    for t, folder in evals.items():
        curate(folder, str(out / "target" / t / "eval.jsonl.gz"), PLAIN + [f"tokenizer.path={tokenizer}"])
    general = out / "general" / "eval"
    curate(general, str(out / "general" / "eval.jsonl.gz"), PLAIN + [f"tokenizer.path={tokenizer}"])
    return tokenizer, evals, general


def domain_tokens(manifest: dict) -> dict[str, int]:
    return {d: int(v["tokens"]) for d, v in manifest["domains"].items() if int(v["tokens"]) > 0}


def mixture_sets(weights: dict[str, float]) -> list[str]:
    return ["mixture.enabled=true", "mixture.method=explicit", f"mixture.weights={json.dumps(weights)}",
            f"mixture.budget_tokens={KEEP_TOKENS}", "mixture.max_epochs=1"]


def aimed_weights(pool_tokens: dict[str, int], domain: str) -> dict[str, float]:
    """MIXTURE_TARGET_SHARE to `domain`, the rest to the other domains in their pool proportions."""
    others = {d: n for d, n in pool_tokens.items() if d != domain}
    return {domain: MIXTURE_TARGET_SHARE, **{d: (1 - MIXTURE_TARGET_SHARE) * n / sum(others.values()) for d, n in others.items()}}


def train_fasttext(out: Path, target: str, pool: Path, seed: int) -> Path:
    """DCLM's setup on this target: `__label__hq` the reference examples, `__label__cc` as many pool documents
    (a seeded sample), one line each."""
    import fasttext

    path = pool.parent / "fasttext" / f"{target}.bin"
    if not path.is_file():
        positives = _read_jsonl(out / "target" / target / "reference.jsonl.gz")
        pool_lines = _read_jsonl(pool)
        negatives = random.Random(seed + 20_000).sample(pool_lines, min(len(positives), len(pool_lines)))
        lines = [f"__label__hq {json.loads(p)['text']}" for p in positives] + [f"__label__cc {json.loads(n)['text']}" for n in negatives]
        random.Random(seed).shuffle(lines)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = path.with_suffix(".txt")
        data.write_text("".join(line.replace("\n", " ") + "\n" for line in lines))
        fasttext.train_supervised(str(data), seed=seed, verbose=0, **FASTTEXT).save_model(str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").replace(path)
    return path


def curate_arms(out: Path, seed: int, target: str, common: list[str], pool: Path, junk: Path, pool_tokens: dict[str, int]) -> dict[str, Path]:
    """Every arm's curated folder for one (pool, target); mixture-matched arms after their selector's."""
    folder = out / "pools" / str(seed) / target
    budget = [f"selection.keep_tokens={KEEP_TOKENS}"]
    reference = f"selection.target={{path: {out / 'target' / target / 'reference.jsonl.gz'}}}"
    natural = {d: n / sum(pool_tokens.values()) for d, n in pool_tokens.items()}
    sets = {
        "random": ["selection.method=random", *budget, f"selection.seed={seed}"],
        "aa": ["selection.method=random", *budget, f"selection.seed={seed + 1000}"],
        "mixture": mixture_sets(aimed_weights(pool_tokens, TARGET_DOMAIN[target])) + [f"mixture.seed={seed}"],
        "classifier": ["selection.method=classifier", reference, *budget, f"selection.seed={seed}"],
        "dsir": ["selection.method=dsir", reference, *budget, f"selection.seed={seed}"],
        "fasttext": ["selection.method=fasttext", f"selection.model={train_fasttext(out, target, pool, seed)}", *budget,
                     f"selection.seed={seed}"],
        "diversity": ["diversity.enabled=true", f"diversity.domains={json.dumps({d: round(KEEP_TOKENS * s) for d, s in natural.items()})}",
                      f"diversity.seed={seed}"],
        "junk": ["selection.method=random", *budget, f"selection.seed={seed}"],
    }
    data = {}
    for arm, arm_sets in sets.items():
        data[arm] = folder / "data" / arm
        curate(data[arm], str(junk if arm == "junk" else pool), common + arm_sets)
    for selector in SELECTORS:  # random at the selector's own per-domain token shares in this pool
        kept = domain_tokens(json.loads((data[selector] / "manifest.json").read_text()))
        weights = {d: kept.get(d, 0) / sum(kept.values()) for d in pool_tokens}  # the mixture names every domain
        data[f"mm_{selector}"] = folder / "data" / f"mm_{selector}"
        curate(data[f"mm_{selector}"], str(pool), common + mixture_sets(weights) + [f"mixture.seed={seed}"])
    return data


def run_pool(out: Path, seed: int, tokenizer: Path, evals: dict[str, Path], general: Path) -> None:
    pool, junk = write_pool(out, seed), write_junk_pool(out, seed)
    base = [f"tokenizer.path={tokenizer}", f"eval.source={general}"]
    # the pool's own domain tokens after normalization and dedup (the mixture arms' proportions), and the junk pool's
    pool_tokens = domain_tokens(curate(out / "pools" / str(seed) / "pool", str(pool), COMMON + base))
    curate(out / "pools" / str(seed) / "pool-junk", str(junk), COMMON + base)
    for target, target_eval in evals.items():
        folder = out / "pools" / str(seed) / target
        # the general set is held out by decontamination as well; the target's eval set is the one each cell tracks
        common = COMMON + [f"tokenizer.path={tokenizer}", f"eval.source={target_eval}"]
        data = curate_arms(out, seed, target, common, pool, junk, pool_tokens)
        spec = {"base": {"recipe": "configs/train-tiny.yaml", "set": TRAIN_SET, "data": str(data["random"])},
                "arms": {arm: {"data": str(data[arm])} for arm in ARMS}, "baseline": "random", "seeds": [seed],
                "budget": {"steps": STEPS, "batch_size": BATCH, "seq_len": SEQ, "eval_every": EVAL_EVERY},
                "eval_source": str(target_eval), "extra_evals": {"general": str(general)}, "output": str(folder / "experiment")}
        (folder / "experiment.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        with open(folder / "experiment.log", "a") as log:
            subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(folder / "experiment.yaml")], check=True,
                           stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/selection2")
    parser.add_argument("--corpus", default=CORPUS)
    parser.add_argument("--pools", type=int, nargs="+", default=POOL_SEEDS[:FIRST_POOLS],
                        help="pool seeds (stage 1's by default; stage 2 adds the next ones of POOL_SEEDS)")
    parser.add_argument("--jobs", type=int, default=1, help="pools run at once, one process each")
    parser.add_argument("--pool", type=int, help=argparse.SUPPRESS)  # one pool, in a child process
    args = parser.parse_args(argv)
    out = Path(args.out)
    counts = split_corpus(out, args.corpus)
    tokenizer, evals, general = prepare(out)
    if args.pool is not None:
        run_pool(out, args.pool, tokenizer, evals, general)
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
