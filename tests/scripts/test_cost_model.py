"""The cost model's request counting: exact answers on small layouts."""

import argparse

from scripts.cost_model import _exchange, _step_bytes, layout, measured_phases, ranges_per_read, requests


def test_the_exact_checks_ranges_merge_only_where_a_task_wants_many_documents_of_a_block():
    lay = layout(1e9, 1e12)  # 61 MB blocks, 1,165 groups
    assert ranges_per_read(lay, 1e9, 0.005) == 1.0  # under one document a (task, block): every frame its own request
    assert 0.99 < ranges_per_read(lay, 1e9, 0.336) < 1.0  # ~35 a (task, block) over 61 MB: hardly any adjacent
    dense = {**lay, "blocks": 100, "groups": 1, "block_bytes": int(1e7)}  # 1e5 documents a 10 MB block, all wanted
    assert ranges_per_read(dense, 1e7, 0.5) < 0.25
    near = {"candidate_pairs": 0.5, "edges": 0.2, "rounds": 4}
    half = requests(lay, 1e9, near, 0.005, 0.5)["minhash resolve"]["spread"]
    assert requests(lay, 1e9, near, 0.005)["minhash resolve"]["spread"] - half == 0.005 * 1e9


def test_an_exchange_grows_as_senders_times_ranges_plus_receivers_once_combined():
    # not combined: every receiver reads a header and a range of every sender's file: 2 x 10 x 5, plus the 10 writes
    assert _exchange(10, 5, None) == {"spread": 10 + 100, "plain": 0}
    # 256 small files fit one combine task: 256 writes, 256 ranges read (2 requests each), 1 combined file (and its
    # record's 2), and each of 5 receivers reads 2 ranges of it
    assert _exchange(256, 5, 1000) == {"spread": 256 + 512 + 1 + 10, "plain": 2}
    # 1 TB's near-dedup keys (16,384 files of 9 MB, 1,165 receivers): 64 groups of 256 (RECEIVER_FILES), each cut
    # into 7 partition ranges to fit COMBINE_BYTES; every sender's range read by 7 tasks, 448 files, 64 a receiver
    assert _exchange(16_384, 1_165, 9e6) == {"spread": 16_384 + 2 * 16_384 * 7 + 448 + 2 * 64 * 1_165, "plain": 896}


def test_resolve_steps_combine_past_a_few_groups():
    assert _step_bytes(1e9, 4) is None  # 2 G^2 <= 8 G: each reads every file
    assert _step_bytes(1e6, 100) == 1.5e4  # small files: combined, at 1.5 x the mean file
    # 1.5 GB files: one does not fit a combine task whole, but 1,000 files are more than a receiver may read: combined
    # 16 to a group, each cut into partition ranges
    assert _step_bytes(1e12, 1000) == 1.5e9


def test_the_layout_is_the_runners_and_the_exact_check_adds_two_reads_a_pair():
    lay = layout(1e9, 1e12)
    assert lay["blocks"] == 16_384 and lay["groups"] == lay["partitions_near"]  # a group per partition at scale
    near = {"candidate_pairs": 0.5, "edges": 0.2, "rounds": 4}
    none, some = requests(lay, 1e9, near, 0.0), requests(lay, 1e9, near, 0.005)
    assert sum(some["minhash resolve"].values()) - sum(none["minhash resolve"].values()) == 2 * 0.005 * 1e9
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
              "minhash clusters": {"serial": True, "cpu_s": 50.0, "byte_s_one_core": 700.0}}
    stall = longest_tasks(phases, {"tokenize": 20.0}, cpu_scale=1_000.0, args=_args())
    assert stall["longest_task_s_by_phase"]["tokenize"] == 1.5 * 20.0 * 1_000.0 / 100  # a mean task x the straggler
    assert (stall["longest_task_phase"], stall["longest_task_s"], stall["within_timeout"]) == ("minhash clusters", 700.0, False)


def test_the_eval_split_adds_its_own_phase_of_requests():
    lay = layout(1e9, 1e12)
    near = {"candidate_pairs": 0.5, "edges": 0.2, "rounds": 4}
    off, on = requests(lay, 1e9, near, 0.05), requests(lay, 1e9, near, 0.05, eval_split=True)
    assert "eval split" not in off and {k: v for k, v in on.items() if k != "eval split"} == off
    # three recorded tasks a block at least (a record's check and write, an output): 9 plain requests a block
    assert on["eval split"]["plain"] >= 9 * lay["blocks"]
