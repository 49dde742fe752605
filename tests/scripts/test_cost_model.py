"""The cost model's request counting: exact answers on small layouts."""

import argparse
import math

from scripts.cost_model import (CANDIDATE_BYTES, EVAL_CHOOSE_TASKS, KEY_BYTES, LOSER_BYTES, PAIR_BYTES,
                                TOKENIZER_SAMPLE_BYTES, WANTED_BYTES, _exchange, _layout, _step_bytes, average_sender_bytes,
                                exact_check_requests, fetch_reads, layout, measured_phases, requests, tokenizer_mb_s)


def test_a_fetch_reads_a_blocks_wanted_frames_in_a_few_ranges():
    lay = layout(1e9, 1e12)  # 61 MB blocks (30 MB of frames), 61,000 documents a block
    for share in (0.01, 0.05, 0.336):  # 610 or more wanted a block, a few KB apart: one range reads them all
        reads = fetch_reads(lay, 1e9, share)
        assert reads["ranges_per_block"] == 1.0 and reads["bytes_per_block"] <= 0.5 * lay["block_bytes"]
    # about 0.06 wanted a block: a block holds one in 17, one range then
    assert fetch_reads(lay, 1e9, 1e-6)["ranges_per_block"] == round(1 - math.exp(-0.061035), 4)
    sparse = fetch_reads(lay, 1e9, 10 / 61_035)  # 10 a block, ~3 MB apart: most gaps are past FETCH_GAP
    assert 5 < sparse["ranges_per_block"] < 10 and sparse["bytes_per_block"] < 0.2 * 0.5 * lay["block_bytes"]
    assert fetch_reads(lay, 1e9, 0.0) == {"ranges_per_block": 0.0, "bytes_per_block": 0.0}


def test_an_exchange_grows_as_senders_times_ranges_plus_receivers_once_combined():
    # 256 small files fit one combine task: 256 writes, 256 files read whole (1 request each), 1 combined file (and
    # its record's 2), and each of 5 receivers reads 2 ranges of it
    assert _exchange(256, 5, 1000) == {"spread": 256 + 256 + 1 + 10, "plain": 2}
    # 1 TB's near-dedup keys (16,384 files of 9 MB, 1,165 receivers): 64 groups of 256 (RECEIVER_FILES) would not fit
    # a combine task whole, so the files are first merged whole into 421 batches of 39 (each read once), then the
    # batches' files 7 to a group (61 groups), each group cut into 7 partition ranges: every batch file's range read
    # by 7 tasks (a header and a range), 427 files, 61 a receiver
    assert _exchange(16_384, 1_165, 9e6) == {"spread": 16_384 + (16_384 + 421) + (2 * 421 * 7 + 427) + 2 * 61 * 1_165,
                                             "plain": 2 * 421 + 2 * 427}


def test_every_exchange_at_the_forced_terabyte_layout_stays_within_four_times_its_tasks():
    """bench_layout's run of 1 TB's layout (16,384 blocks of 4 documents, 233 exact and 1,165 near partitions, 1,165
    groups), each exchange as `exchange.layout` lays it out: near dedup's buckets are read twice (the groups' gather
    and the eval split's match, a header and a range of each file of the group's range), the rest once."""
    docs, m, pe, g = 65_536, 16_384, 233, 1_165
    lay = layout(docs, 235e6, blocks=m, partitions=g, groups=g)  # the run's 235 MB
    buckets = _layout(m, g, lay["near_bucket_bytes"])
    exchanges = {  # name: (requests, senders, receivers)
        "ids and exact dedup's keys": (_exchange(m, pe, average_sender_bytes(docs, m, KEY_BYTES)), m, pe),
        "near dedup's buckets": ({**_exchange(m, g, lay["near_bucket_bytes"]), "match": 2 * g * buckets.groups}, m, g),
        "near dedup's nodes": (_exchange(m, g, lay["near_keys_bytes"]), m, g),
        "the tokenizer's sample": (_exchange(m, 1, TOKENIZER_SAMPLE_BYTES / m), m, 1),
        "the eval split's candidates": (_exchange(m, EVAL_CHOOSE_TASKS, CANDIDATE_BYTES), m, EVAL_CHOOSE_TASKS),
        # the losers split by the 16 input files' units: of exact dedup's partitions, of near dedup's groups
        "exact dedup's losers by unit": (_exchange(pe, 16, average_sender_bytes(docs // 10, pe, LOSER_BYTES)), pe, 16),
        "near dedup's losers by unit": (_exchange(g, 16, average_sender_bytes(docs // 10, g, LOSER_BYTES)), g, 16),
        "a group-to-group step (pairs-v)": (_exchange(g, g, _step_bytes(docs * PAIR_BYTES["pairs-v"], g)), g, g),
        # the exact check's 5% of documents near the threshold: one fetch task (6 MB of frames)
        "the wanted documents": (_exchange(g, 1, _step_bytes(0.1 * docs * WANTED_BYTES, g), m), g, 1),
        "the frames": (_exchange(1, g, 0.1 * docs * 1_800), 1, g),
        "the eval split's edges": (_exchange(g, 1, 1_000), g, 1),
    }
    over = {name: (sum(r.values()), 4 * (s + n)) for name, (r, s, n) in exchanges.items() if sum(r.values()) > 4 * (s + n)}
    assert over == {}
    # the buckets: 16,384 written and read whole by 4 combine tasks, 4 files each of 1,165 receivers reads twice
    assert buckets.groups == 4 and len(buckets.starts) == 1


def test_an_exchange_reads_the_senders_files_directly_while_that_stays_within_the_bound():
    # 4 senders, 4 receivers: each receiver reads a header and a range of every file, 2 x 4 x 4 <= 4 x (4 + 4)
    assert _exchange(4, 4, 1e6) == {"spread": 4 + 32, "plain": 0}
    # 5 and 5: 50 > 40, so combined into one file: 5 written, read whole, 1 file (and its record), 5 x 2 reads
    assert _exchange(5, 5, 1e6) == {"spread": 5 + 5 + 1 + 10, "plain": 2}
    # 1.5 GB files: no two fit a combine task, and 10 are few enough for a receiver to read them all
    assert _exchange(10, 10, 1.5e9) == {"spread": 10 + 200, "plain": 0}
    assert _step_bytes(1e6, 100) == 1.5e4  # a step's largest group file: 1.5 x the mean


def test_the_layout_is_the_runners_and_the_exact_check_reads_by_block():
    lay = layout(1e9, 1e12)
    assert lay["blocks"] == 16_384 and lay["groups"] == lay["partitions_near"]  # a group per partition at scale
    near = {"candidate_pairs": 0.5, "edges": 0.2, "rounds": 4}
    none, some = requests(lay, 1e9, near, 0.0), requests(lay, 1e9, near, 0.05)
    added = sum(some["minhash resolve"].values()) - sum(none["minhash resolve"].values())
    assert added == sum(exact_check_requests(lay, 1e9, 0.05).values()) - sum(exact_check_requests(lay, 1e9, 0.0).values())
    # one range a block (16,384), far from a request per wanted document (2 x 5% x 1e9 = 100 M); the rest is the two
    # exchanges (groups to fetch tasks, fetch tasks to groups) and the fetch tasks' records
    assert 16_384 < added < 250_000
    assert {k: v for k, v in some.items() if k != "minhash resolve"} == {k: v for k, v in none.items() if k != "minhash resolve"}


def test_measured_steps_are_grouped_into_the_models_phases():
    run = {"step_seconds": {"read": 3.0, "unique_ids": 1.0, "unique_ids combine": 0.5, "exact_dedup": 2.0,
                            "exact_dedup resolve": 1.0, "exact_dedup losers by unit": 0.25, "minhash pairs": 1.0,
                            "minhash verify": 2.0, "minhash clusters": 0.5, "minhash drop": 1.5, "filters+minhash": 4.0,
                            "tokenizer sample": 0.5, "tokenize": 6.0, "shards plan": 0.1, "shards": 1.0},
           "phase_seconds": {"start": 2.0, "write": 0.2, "clean up": 0.3, "tokenize": 9.0}}
    assert measured_phases(run) == {"read": 3.0, "unique ids": 1.5, "exact_dedup": 2.0, "exact_dedup resolve": 1.25,
                                    "minhash resolve": 3.0, "minhash clusters": 0.5, "minhash drop": 1.5,
                                    "filters+minhash": 4.0, "tokenize": 6.5, "shards": 1.1, "start": 2.0, "write": 0.2,
                                    "clean up": 0.3}


def test_the_tokenizers_training_rate_is_the_cpu_runs_own_on_the_text_that_reached_it():
    args = argparse.Namespace(tokenizer_mb_s=7.3, tokenizer_sample_mb=200.0)
    funnel = [{"stage": "read", "domains": {"a": {"bytes_out": 500e6}}},
              {"stage": "minhash", "domains": {"a": {"bytes_out": 90e6}, "b": {"bytes_out": 30e6}}}]
    run = {"step_seconds": {"tokenizer train": 40.0, "tokenize": 2.0}, "funnel": funnel}
    assert tokenizer_mb_s(args, run) == 3.0  # 120 MB kept, all of it under the sample's 200 MB
    funnel[-1]["domains"]["b"]["bytes_out"] = 400e6  # more kept than the sample: training read 200 MB
    assert tokenizer_mb_s(args, run) == 5.0
    assert tokenizer_mb_s(args, {"step_seconds": {"tokenize": 2.0}, "funnel": funnel}) == 7.3
    assert tokenizer_mb_s(args, None) == 7.3


def _args(**kw):
    base = {"prefix_rate": 100.0, "cold_doubling_min": 1.0, "straggler": 1.5, "stall_timeout_s": 600.0}
    return argparse.Namespace(**{**base, **kw})


def test_a_cold_bucket_serves_at_its_first_rate_and_doubles_with_time():
    from scripts.cost_model import cold_bucket

    # 1,000 requests at the start: ~100 a second (the doubling is a minute away): 10 s, slower than the phase's 2 s
    phases = {"read": {"requests": 1_000, "serial": False, "seconds": 2.0, "bound": "cpu"}}
    cold_bucket(phases, _args())
    assert phases["read"]["seconds"] == 10.0 and phases["read"]["bound"] == "cold bucket"
    # after 10 minutes of a run the capacity has doubled ten times, past the prefixes' cap (256 x 100 a second)
    phases = {"start": {"requests": 0, "serial": True, "seconds": 600.0, "bound": "cpu"},
              "read": {"requests": 1_000, "serial": False, "seconds": 2.0, "bound": "cpu"}}
    cold_bucket(phases, _args())
    assert phases["read"]["seconds"] == 2.0 and phases["read"]["cold_s"] == 1.0


def test_the_longest_task_is_held_against_the_stall_timeout():
    from scripts.cost_model import longest_tasks

    phases = {"tokenize": {"serial": False, "tasks": 100, "cpu_s": 10.0},
              "minhash clusters": {"serial": False, "tasks": 256, "cpu_s": 3.0},
              "tokenizer": {"serial": True, "cpu_s": 700.0}}
    stall = longest_tasks(phases, {"tokenize": 20.0, "minhash clusters": 100.0}, cpu_scale=1_000.0, args=_args())
    assert stall["longest_task_s_by_phase"]["tokenize"] == 1.5 * 20.0 * 1_000.0 / 100  # a mean task x the straggler
    assert stall["longest_task_s_by_phase"]["minhash clusters"] == round(1.5 * 100.0 * 1_000.0 / 256, 1)  # a range's
    assert (stall["longest_task_phase"], stall["longest_task_s"], stall["within_timeout"]) == ("tokenizer", 700.0, False)


def test_the_eval_split_adds_its_own_phase_of_requests():
    lay = layout(1e9, 1e12)
    near = {"candidate_pairs": 0.5, "edges": 0.2, "rounds": 4}
    off, on = requests(lay, 1e9, near, 0.05), requests(lay, 1e9, near, 0.05, eval_split=True)
    assert "eval split" not in off and {k: v for k, v in on.items() if k != "eval split"} == off
    # three recorded tasks a block at least (a record's check and write, an output), all below hashed prefixes: 9
    # spread requests a block; the two files every block reads (held, near) are one key each: 2 plain ones a block
    assert on["eval split"]["spread"] >= 9 * lay["blocks"] and on["eval split"]["plain"] >= 2 * lay["blocks"]


def test_the_formula_counts_a_batched_exchange_on_the_s3_server_request_for_request(s3_server, monkeypatch):
    """12 senders to 4 receivers, every partition in every file, with COMBINE_BYTES fitting two files and 2 files a
    receiver: the senders are merged whole into 6 batches, the batches into 2 groups in 3 partition ranges, and each
    receiver reads its range of both groups' files. Every PUT and GET the S3 server sees through a counting proxy is
    one the formula (`_exchange`) counts (no records here: the combines run in this process, unrecorded)."""
    import uuid

    import numpy as np
    import pyarrow as pa
    import s3fs

    from datapipe.core import exchange
    from datapipe.core.exchange import Exchange, route
    from datapipe.core.shuffle import write_shuffle
    from datapipe.testing.latency_proxy import LatencyProxy

    folder = f"s3://{s3_server[1]}/{uuid.uuid4().hex[:12]}/keys"
    names = tuple(f"b{i}" for i in range(12))
    with LatencyProxy(s3_server[0], 0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        from datapipe.core.storage import location

        sizes = [write_shuffle(location(folder) / f"{n}.shuffle", pa.table({"order": np.arange(40, dtype=np.int64) + 40 * i}),
                               np.arange(40) % 4, 4) for i, n in enumerate(names)]
        monkeypatch.setattr(exchange, "COMBINE_BYTES", 6 * max(sizes) + 1)
        monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)
        combines, received = exchange.plan(Exchange("keys", folder, names, 4, max(sizes)))
        route(lambda fn, shared, items, desc, record=None: [fn(shared, *item) for item in items],
              Exchange("keys", folder, names, 4, max(sizes)))
        rows = [received.read(p).num_rows for p in range(4)]
        counted = dict(proxy.requests)
    s3fs.S3FileSystem.clear_instance_cache()
    assert rows == [120] * 4 and [(c.prefix, c.groups, len(c.starts)) for _, c in combines] == [("batch", 6, 1), ("combined", 2, 3)]
    formula = _exchange(12, 4, max(sizes))
    assert counted.get("PUT", 0) + counted.get("GET range", 0) == formula["spread"]
    assert formula["plain"] == 2 * (6 + 2 * 3)  # the records the formula counts beside: none written here


def test_a_receiver_reads_a_large_header_in_pieces_and_a_lone_receiver_reads_each_file_whole():
    """A shuffle file of 16,384 partitions (the wanted documents, by block) has a header past 64 KiB: a range read is
    its four pieces and the range, 5 requests (`shuffle.range_requests`, what `read_shuffle` issues); a receiver of
    every partition reads a file in one request."""
    from datapipe.core.shuffle import range_requests

    assert (range_requests(233), range_requests(16_384)) == (2, 5)
    assert _exchange(4, 4, 1e6, 16_384) == {"spread": 4 + 5 * 4 * 4, "plain": 0}
    assert _exchange(4, 1, 1e6) == {"spread": 4 + 4, "plain": 0}


def test_a_phase_adds_its_tasks_cpu_requests_and_bytes_and_the_prefix_rate_is_a_floor(monkeypatch):
    """A task reads, computes and writes in turn: each phase of the 1 TB projection takes the sum of its CPU, its
    requests' latency and its bytes, or S3's per-prefix limit where that is longer (warm bucket: no cold start)."""
    import sys
    from pathlib import Path

    from scripts import cost_model

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.setattr(sys, "argv", ["cost_model", "--scale", str(bench / "scale_4x.json"), "--warm-bucket"])
    args = cost_model.arguments()
    scale = __import__("json").loads((bench / "scale_4x.json").read_text())
    phases = cost_model.project(scale, args.docs, args.text_bytes, args)["phases"]
    for name, p in phases.items():
        if not p["serial"]:
            assert p["seconds"] == max(round(p["cpu_s"] + p["request_s"] + p["byte_s"], 1), p["prefix_s"]), name
    assert any(p.get("byte_s", 0) > 0.1 * p["cpu_s"] > 0 for p in phases.values())  # the bytes are not lost in a max
