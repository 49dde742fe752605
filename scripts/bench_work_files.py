"""Work files of a curate run: bytes and objects per phase folder, per document; prints one JSON object.

usage: python -m scripts.bench_work_files [--corpus ../shared/data/corpus.jsonl.gz] [--partitions 4,32]
                                          [--baseline-tree /tmp/datapipe-old]

Runs the shipped recipe (`configs/quickstart.yaml`, its `auto` blocks, verification on) on the corpus with
`output.keep_work: true`, once per `dedup.minhash.partitions`, each in a fresh process (`datapipe curate` on
1 Ray CPU: the files do not depend on the worker count), and counts what `OUT/work/` holds: bytes and files
under each top folder (read, segments, exact_dedup, minhash, tokens, eval, ...), and for near dedup its bytes
per document. With `--baseline-tree` (a checkout of an earlier commit) the same runs of that tree go beside
them, so the two layouts are compared on the same corpus and settings. Whether the shards are identical
across partition counts is reported too (they must be).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench_driver_memory import work_files

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, corpus: str, partitions: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "datapipe.cli", "curate", str(ROOT / "configs" / "quickstart.yaml"), "--input", corpus,
           "--output", str(out), "--set", "output.keep_work=true", "--set", f"dedup.minhash.partitions={partitions}",
           "--set", "ray.num_cpus=1", "--set", "inputs.0.domain_field=source"]  # the corpus's domains: the recipe's filters run
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"curate failed ({tree}):\n{proc.stderr[-3000:]}")
    stats = json.loads((out / "stats.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    read_docs = sum(row["read"] for row in stats["inputs"])
    text_bytes = next(f for f in stats["funnel"] if f["stage"] == "read")
    text_bytes = sum(d["bytes_out"] for d in text_bytes["domains"].values())
    sizes = work_files(out / "work")
    minhash_docs = sum(d["docs_in"] for f in stats["funnel"] if f["stage"] == "minhash" for d in f["domains"].values())
    return {
        "documents": read_docs,
        "text_bytes": text_bytes,
        "work": sizes,
        "work_over_text": round(sizes["total"]["bytes"] / text_bytes, 3),
        "near_dedup_bytes_per_document": round(sizes.get("minhash", {"bytes": 0})["bytes"] / max(minhash_docs, 1), 1),
        "shards": [s["sha256"] for s in manifest["shards"]],
        "seconds": stats["seconds"],
        # near dedup's exact check: pairs checked, documents and bytes read for them (the cost model's input)
        "near_dedup": {k: v for k, v in stats["global_stages"].get("minhash", {}).items() if k.startswith(("exact", "candidate"))},
        "minhash_documents": minhash_docs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "corpus.jsonl.gz"))
    parser.add_argument("--partitions", default="4,32")
    parser.add_argument("--baseline-tree", default=None, help="a checkout of another commit, run beside this one")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})}
    report: dict = {"corpus": args.corpus, "recipe": "configs/quickstart.yaml", "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in trees.items():
            for p in [int(x) for x in args.partitions.split(",")]:
                result = run(tree, args.corpus, p, Path(tmp) / f"{name}-p{p}")
                report["runs"][f"{name} partitions={p}"] = result
                print(f"{name} partitions={p}: work {result['work']['total']}", file=sys.stderr, flush=True)
    for name in trees:
        runs = [v for k, v in report["runs"].items() if k.startswith(name + " ")]
        report[f"{name}_shards_identical_across_partitions"] = all(r["shards"] == runs[0]["shards"] for r in runs)
        if len(runs) == 2:
            report[f"{name}_files_ratio_{args.partitions.replace(',', '_to_')}"] = round(
                runs[1]["work"]["total"]["files"] / runs[0]["work"]["total"]["files"], 3)
    for r in report["runs"].values():
        r["shards"] = len(r["shards"])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
