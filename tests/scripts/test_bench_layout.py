"""The 1 TB layout benchmark's own arithmetic: the layout it asks for, the corpus it plants, the fan-in it reads
off the files a run wrote (the run itself is `python -m scripts.bench_layout`, in BENCHMARKS.md)."""

import gzip
import json

from scripts.bench_driver_memory import NEAR_THRESHOLD_J
from scripts.bench_layout import exchange_fan_in, pieces, target_layout, web_recipe, write_pieces


def test_the_layout_asked_for_is_the_runners_for_a_terabyte_scaled_alike():
    full = target_layout(1.0)
    assert (full["blocks"], full["partitions_exact"], full["partitions_near"], full["groups"]) == (16_384, 233, 1_165, 1_165)
    sixteenth = target_layout(1 / 16)
    assert (sixteenth["blocks"], sixteenth["partitions_exact"], sixteenth["partitions_near"]) == (1_024, 15, 73)


def test_the_recipe_is_web_yaml_with_its_layout_forced():
    recipe = web_recipe(target_layout(1.0), 16_384 * 1_000)
    assert recipe["read"]["block_bytes"] == 1_000
    assert (recipe["dedup"]["exact"]["partitions"], recipe["dedup"]["minhash"]["partitions"]) == (233, 1_165)
    assert set(recipe["filters"]["*"]) == {"gopher_quality", "gopher_repetition", "c4", "fineweb"}
    assert recipe["eval"]["enabled"] and "inputs" not in recipe and "output" not in recipe


def test_the_corpus_plants_near_threshold_and_exact_copies_of_real_pieces(tmp_path):
    source = tmp_path / "src.jsonl.gz"
    with gzip.open(source, "wt") as f:
        for i in range(70):  # three pieces each
            words = [f"word{i}x{j}" for j in range(600)]
            f.write(json.dumps({"text": " ".join(words), "source": "man" if i % 2 else "code"}) + "\n")
    counts = write_pieces(tmp_path / "corpus", 200, source, near_share=0.2)
    rows = [json.loads(line) for p in sorted((tmp_path / "corpus").glob("*.jsonl")) for line in p.open()]
    assert len(rows) == 200 and len({r["id"] for r in rows}) == 200
    assert 20 < counts["planted"]["near_threshold"] < 60 and counts["planted"]["exact"] > 0
    lo, hi = counts["near_jaccard_range"]
    assert NEAR_THRESHOLD_J[0] - 0.03 <= lo <= hi <= NEAR_THRESHOLD_J[1] + 0.03
    originals = {p["text"] for p in pieces(source, 200)}
    # every document but the near copies is a piece as it was (an exact copy repeats one)
    assert sum(r["text"] in originals for r in rows) == 200 - counts["planted"]["near_threshold"]
    assert len({r["text"] for r in rows}) < 200


def test_the_fan_in_is_read_off_the_files_each_exchange_wrote():
    written = {
        # 8 senders combined in 2 groups, each cut in 3 ranges: a receiver reads 2 files, a combine task merged 4
        "work/minhash/nodes": {f"work/minhash/nodes/ab/b{i}.shuffle" for i in range(8)}
        | {f"work/minhash/nodes/cd/combined-r{r:03d}-{k:05d}.shuffle" for r in range(3) for k in range(2)},
        # 12 senders merged whole into 4 batches of 3, the batches into 2 groups in 2 ranges: a combine task merged 3
        "work/ids/keys": {f"work/ids/keys/ab/b{i}.shuffle" for i in range(12)}
        | {f"work/ids/keys/cd/batch-{k:05d}.shuffle" for k in range(4)}
        | {f"work/ids/keys/ef/combined-r{r:03d}-{k:05d}.shuffle" for r in range(2) for k in range(2)},
        # a small exchange read directly: every receiver reads all 3 group files
        "work/minhash/pairs-u": {f"work/minhash/pairs-u/ef/g{g:03d}.shuffle" for g in range(3)},
        "work/read": {"work/read/u000000-b00000.arrow"},
    }
    fan_in = exchange_fan_in(written)
    assert fan_in["receiver_files_by_folder"] == {"work/ids/keys": 2, "work/minhash/nodes": 2, "work/minhash/pairs-u": 3}
    assert fan_in["sender_files_a_combine_task_by_folder"] == {"work/ids/keys": 3, "work/minhash/nodes": 4}
    assert (fan_in["most_files_a_receiver_reads"], fan_in["in_folder"]) == (3, "work/minhash/pairs-u")
