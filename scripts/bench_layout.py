"""The planner's layout for 1 TB / 1 B documents, executed on a real S3 API server at small size; prints one JSON object.

usage: python -m scripts.bench_layout [--fraction 1] [--docs-per-block 4] [--near-share 0.05] [--workers 2]
                                      [--source ../shared/data/corpus.jsonl.gz] [--save-log PATH]
       python -m scripts.bench_layout --cpu 100000 [--workers 2]     # CPU per byte of web.yaml, local disk

With `--cpu N`: N documents of the same kind (real sentences web.yaml's filters keep, the same planted copies) on
a local disk, web.yaml as shipped with its own `auto` layout, on an embedded Ray with `--workers` CPUs: the whole
process tree's CPU seconds (`scripts.bench_curate`'s sampling of /proc), each phase's seconds, and each phase's
CPU per MB of input text (its seconds x workers): what `scripts.cost_model --cpu-run` scales to 1 TB.

A layout test, not a data-volume test: the run has the task and object counts of a 1 TB run and little text.
`scripts.cost_model.layout(1e9, 1e12)` gives what the runner's `auto` rules choose for 1 TB (16,384 blocks, 233
exact-dedup and id partitions, 1,165 near-dedup partitions resolved in 1,165 groups); `--fraction` scales every
count of it down alike (1/16: 1,024 blocks) for a quicker look. The corpus is real sentences (`--source`, the
shared corpus: its documents cut into pieces of about 200 words, the first 2,000 pieces that the recipe's filters keep
give the sentences, 12 drawn at random make a document, kept if the filters keep it: the shared corpus's manual pages
and code mostly fail web text's filters, and a layout test needs its documents to reach near dedup; the filters still
run on every document in the run), `--docs-per-block` documents a block, with `--near-share`
of them planted as copies of an earlier piece at a word 5-gram Jaccard drawn around the threshold (0.76-0.84, as
`scripts.bench_driver_memory` plants them: near dedup's exact check decides each) and 5% as exact copies.

The recipe is `configs/web.yaml` as it ships (its four filters on every domain and the code filter on `code`, its
tokenizer's settings, the eval split on), with the layout forced: `read.block_bytes` from the corpus's bytes, the
partitions, and `near_dedup.GROUP_DOCS` (1) so that the groups are the partitions. Input and output on the server
(`scripts.bench_s3_requests.run_on_server`, which counts every request the server answers).

Reported: the layout asked for and the one the run made; per phase (the key's folder below work/) its requests by
method and status, its task records and shuffle files; every shuffle folder against 4 x (senders + receivers);
the most files a receiver of an exchange reads (per combined range, the files of that range; where a folder's
senders are read directly, all of them) and the most sender files a combine task merges; the driver's peak
resident memory; wall and each step's seconds; the exact check's reads (its fetch tasks', by block).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

from scripts.bench_driver_memory import FILES, NEAR_THRESHOLD_J, near_threshold_copy, shingle_jaccard
from scripts.bench_s3_requests import run_on_server
from scripts.cost_model import layout

REPO = Path(__file__).resolve().parents[1]
PIECE_WORDS = 200  # words in a corpus piece: a web page's paragraph or few
POOL = 2_000  # kept pieces whose sentences make the documents
SENTENCES = 12  # sentences a document
EXACT_SHARE = 0.05
_COMBINED = re.compile(r"combined-(?:r(\d+)-)?\d+\.shuffle$")
_BATCH = re.compile(r"batch-\d+\.shuffle$")  # a first level's files, where a group did not fit a combine task


def target_layout(fraction: float) -> dict[str, int]:
    """The runner's layout for 1 TB / 1 B documents, every count scaled by `fraction` (at least 1)."""
    full = layout(1e9, 1e12)
    scale = lambda n: max(1, math.ceil(n * fraction))
    return {"blocks": scale(full["blocks"]), "partitions_exact": scale(full["partitions_exact"]),
            "partitions_near": scale(full["partitions_near"]), "groups": scale(full["groups"]),
            "full_1tb": {k: full[k] for k in ("blocks", "partitions_exact", "partitions_near", "groups")}}


def pieces(source: Path, count: int, keep: Callable[[str, str], bool] | None = None, seed: int = 0) -> list[dict[str, str]]:
    """`count` documents of real sentences with their domain. The source's documents are cut into pieces of about
    PIECE_WORDS words, taken from each domain in turn, those `keep(text, domain)` refuses skipped; the first POOL
    kept pieces give the sentences, and each document is SENTENCES of them drawn at random (seeded) from one
    piece's domain: as many distinct documents as asked, however few pieces the recipe keeps."""
    by_domain: dict[str, list[str]] = {}
    with gzip.open(source, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            by_domain.setdefault(doc["source"], []).append(doc["text"])
    streams = [((domain, piece) for text in texts for piece in _cut(text)) for domain, texts in sorted(by_domain.items())]
    kept: list[tuple[str, str]] = []
    while streams and len(kept) < POOL:
        for stream in list(streams):
            found = next(((d, t) for d, t in stream if keep is None or keep(t, d)), None)
            if found is None:
                streams.remove(stream)
            else:
                kept.append(found)
    sentences: dict[str, list[str]] = {}
    for domain, text in kept:
        sentences.setdefault(domain, []).extend(s.strip() + "." for s in text.split(". ") if len(s.split()) >= 4)
    if not sentences:
        raise SystemExit(f"{source}: the recipe keeps none of its pieces")
    rng = np.random.default_rng(seed)
    domains = [d for d, _ in kept]
    out: list[dict[str, str]] = []
    while len(out) < count:
        domain = domains[int(rng.integers(len(domains)))]
        pool = sentences[domain]
        text = " ".join(pool[int(i)] for i in rng.integers(len(pool), size=SENTENCES))
        if keep is None or keep(text, domain):
            out.append({"text": text, "source": domain})
    return out


def _cut(text: str) -> list[str]:
    words = text.split(" ")
    return [" ".join(words[at:at + PIECE_WORDS]) for at in range(0, len(words), PIECE_WORDS)
            if len(words[at:at + PIECE_WORDS]) >= 20]


def recipe_keeps(recipe: dict[str, Any]) -> Callable[[str, str], bool]:
    """Whether a text passes the recipe's filters for its domain (`stages.quality.build_filters`)."""
    from stages.quality import build_filters

    per_domain, default = build_filters(recipe.get("filters") or {})
    return lambda text, domain: all(not f.check(text) for f in [*default, *per_domain.get(domain, [])])


def write_pieces(folder: Path, docs: int, source: Path, near_share: float, seed: int = 0,
                 keep: Callable[[str, str], bool] | None = None) -> dict[str, Any]:
    """`docs` documents in FILES JSONL files: real pieces (that `keep` keeps), `near_share` of them near-threshold
    copies of an earlier piece and EXACT_SHARE exact copies; the counts planted and the Jaccards the near copies
    were made at."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    originals = pieces(source, docs, keep)
    kind = rng.random(docs)
    planted, jaccards, text_bytes = Counter(), [], 0
    per_file = -(-docs // FILES)
    for f in range(FILES):
        with open(folder / f"part-{f:02d}.jsonl", "w", encoding="utf-8") as out:
            for i in range(f * per_file, min(docs, (f + 1) * per_file)):
                doc = dict(originals[i])
                if i > 0 and kind[i] < near_share + EXACT_SHARE:
                    base = originals[int(rng.integers(max(0, i - 1000), i))]
                    doc["source"] = base["source"]
                    if kind[i] < near_share:
                        words = base["text"].split(" ")
                        copy = near_threshold_copy(words, float(rng.uniform(*NEAR_THRESHOLD_J)), i)
                        jaccards.append(shingle_jaccard(words, copy))
                        doc["text"] = " ".join(copy)
                        planted["near_threshold"] += 1
                    else:
                        doc["text"] = base["text"]
                        planted["exact"] += 1
                doc["id"] = f"d{i}"
                text_bytes += len(doc["text"].encode())
                out.write(json.dumps(doc) + "\n")
    return {"docs": docs, "bytes": text_bytes, "files": FILES, "planted": dict(planted),
            "near_jaccard_range": [round(min(jaccards), 3), round(max(jaccards), 3)] if jaccards else None}


def web_recipe(lay: dict[str, int], text_bytes: int) -> dict[str, Any]:
    """configs/web.yaml as it ships, its layout forced to `lay` (its inputs and output are the server's)."""
    recipe = yaml.safe_load((REPO / "configs" / "web.yaml").read_text())
    for key in ("inputs", "output"):
        recipe.pop(key, None)
    recipe["read"] = {**recipe.get("read", {}), "block_bytes": max(256, text_bytes // lay["blocks"])}
    recipe["dedup"]["exact"]["partitions"] = lay["partitions_exact"]
    recipe["dedup"]["minhash"]["partitions"] = lay["partitions_near"]
    return recipe


def exchange_fan_in(written: dict[str, set[str]]) -> dict[str, Any]:
    """From the shuffle files each folder wrote: the files a receiver of each exchange reads (a combined folder: the
    files of one range; otherwise every sender's file) and the sender files a combine task merged."""
    receivers: dict[str, int] = {}
    combines: dict[str, int] = {}
    for folder, keys in sorted(written.items()):
        shuffles = [k for k in keys if k.endswith(".shuffle")]
        if not shuffles:
            continue
        by_range = Counter(m.group(1) or "0" for k in shuffles if (m := _COMBINED.search(k)))
        batches = sum(1 for k in shuffles if _BATCH.search(k))
        senders = len(shuffles) - sum(by_range.values()) - batches
        if by_range:
            receivers[folder] = groups = max(by_range.values())
            # with batches, two levels: the senders merged into the batches, the batches into the groups
            merged = [(senders, batches), (batches, groups)] if batches else [(senders, groups)]
            combines[folder] = max(-(-a // b) for a, b in merged) if senders else 0
        else:
            receivers[folder] = senders
    top = max(receivers.items(), key=lambda kv: kv[1], default=(None, 0))
    top_combine = max(combines.items(), key=lambda kv: kv[1], default=(None, 0))
    return {"most_files_a_receiver_reads": top[1], "in_folder": top[0],
            "most_sender_files_a_combine_task_merges": top_combine[1], "combine_in_folder": top_combine[0],
            "receiver_files_by_folder": receivers, "sender_files_a_combine_task_by_folder": combines}


def _written_by_folder(folders: dict[str, Any]) -> dict[str, set[str]]:
    return {name: set(tally.written) for name, tally in folders.items()}


def cpu_run(docs: int, workers: int, source: Path, near_share: float) -> dict[str, Any]:
    """web.yaml on `docs` documents of real sentences on a local disk (see the module docstring)."""
    import sys

    from scripts.corpus import run_measured

    root = Path(tempfile.mkdtemp(prefix="bench-web-cpu-"))
    try:
        recipe = web_recipe(target_layout(1.0), 1)
        corpus = write_pieces(root / "corpus", docs, source, near_share, keep=recipe_keeps(recipe))
        recipe.pop("read")  # web.yaml's own `auto` layout for this input
        recipe["dedup"]["exact"]["partitions"] = recipe["dedup"]["minhash"]["partitions"] = "auto"
        recipe.update(inputs=[{"path": str(root / "corpus" / "*.jsonl"), "domain_field": "source"}],
                      output={"dir": str(root / "out")}, ray={"num_cpus": workers})
        (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        cmd = [sys.executable, "-m", "datapipe.cli", "curate", str(root / "recipe.yaml"), "--no-progress"]
        returncode, err, wall, cpu = run_measured(cmd, REPO, {**os.environ, "PYTHONPATH": str(REPO)})
        if returncode != 0:
            raise SystemExit(f"curate failed:\n{err.decode()[-4000:]}")
        stats = json.loads((root / "out" / "stats.json").read_text())
        mb = corpus["bytes"] / 1e6
        return {"corpus": corpus, "workers": workers, "wall_seconds": round(wall, 1),
                "process_tree_cpu_seconds": round(cpu, 1), "process_tree_cpu_s_per_mb": round(cpu / mb, 4),
                "phase_seconds": stats["phase_seconds"], "step_seconds": stats.get("step_seconds", {}),
                "phase_cpu_s_per_mb": {k: round(v * workers / mb, 5) for k, v in stats["phase_seconds"].items()},
                "funnel": stats.get("funnel")}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", type=float, default=1.0, help="scale every count of the 1 TB layout by this")
    parser.add_argument("--docs-per-block", type=int, default=4)
    parser.add_argument("--near-share", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--source", default=str(REPO.parent / "shared" / "data" / "corpus.jsonl.gz"))
    parser.add_argument("--save-log", default=None)
    parser.add_argument("--cpu", type=int, default=None, help="measure web.yaml's CPU per byte on this many documents")
    args = parser.parse_args()
    if args.cpu:
        result = cpu_run(args.cpu, args.workers, Path(args.source), args.near_share)
        print(json.dumps({"command": f"python -m scripts.bench_layout --cpu {args.cpu} --workers {args.workers}", **result},
                         indent=1))
        return
    lay = target_layout(args.fraction)
    docs = lay["blocks"] * args.docs_per_block
    corpus_box: dict[str, Any] = {}

    keep = recipe_keeps(web_recipe(lay, 1))

    def write(folder: Path) -> dict[str, Any]:
        corpus_box.update(write_pieces(folder, docs, Path(args.source), args.near_share, keep=keep))
        return corpus_box

    # the block size needs the corpus's bytes: write once to measure, then run with the forced layout
    probe = Path(tempfile.mkdtemp(prefix="bench-layout-"))
    try:
        text_bytes = write_pieces(probe, docs, Path(args.source), args.near_share, keep=keep)["bytes"]
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    recipe = web_recipe(lay, text_bytes)
    group_docs = 1  # groups = min(partitions, documents reaching near dedup): one per partition, as at 1 TB
    result = run_on_server(recipe, write, docs, workers=args.workers, keep_work=False, group_docs=group_docs,
                           save_log=args.save_log, input_options={"domain_field": "source"}, folder_tallies=True)
    tallies = result.pop("folder_tallies")
    stats = result.pop("stats")
    near = stats.get("global_stages", {}).get("minhash", {})
    print(json.dumps({
        "command": "python -m scripts.bench_layout " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "source"),
        "layout_asked": lay, "group_docs": group_docs, "block_bytes": recipe["read"]["block_bytes"],
        "exchange_fan_in": exchange_fan_in(_written_by_folder(tallies)),
        "near_dedup": {k: v for k, v in near.items() if k.startswith(("exact", "verify", "tasks", "removed", "checked"))},
        "funnel": stats.get("funnel"),
        **result,
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
