"""The curation runner end to end, in-process (LocalExecutor): outputs, accounting, bad input,
resume after a kill, refusal of a foreign output folder."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ASSETS, CrashAfter, Interrupted as _Interrupt, PassThrough, small_config
from datapipe.core.config import ConfigError
from datapipe.curation.executors import LocalExecutor
from datapipe.curation.identity import RunConflict
from datapipe import curate
from datapipe.core.shards import open_shard, read_manifest, verify_shard


def run(cfg, **kw):
    return curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None, **kw)


def shard_rows(out: Path) -> list[dict]:
    manifest = read_manifest(out)
    rows = []
    for s in manifest["shards"]:
        rows += open_shard(out, s["path"]).to_pylist()
    return rows


def dropped_rows(out: Path) -> list[dict]:
    files = sorted((out / "dropped").glob("*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).to_pylist() if files else []


def quarantined(out: Path) -> list[dict]:
    return [orjson.loads(line) for f in sorted((out / "quarantine").glob("*.jsonl")) for line in f.read_bytes().splitlines()]


def checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]]


def test_end_to_end_outputs(tmp_path, slice_input):
    out = tmp_path / "out"
    result = run(small_config(out, [slice_input]))
    manifest = read_manifest(out)
    assert manifest["num_shards"] == len(manifest["shards"]) > 1  # tiny shard_bytes: several shards
    assert (out / "stats.json").exists() and (out / "tokenizer.json").exists()
    assert not (out / "work").exists()  # intermediate files removed after success
    rows = shard_rows(out)
    assert len(rows) == manifest["total_docs"] == sum(s["rows"] for s in manifest["shards"])
    eos = manifest["tokenizer"]["eos_id"]
    for r in rows:
        assert r["tokens"][-1] == eos and len(r["tokens"]) == r["num_tokens"]
        assert eos not in r["tokens"][:-1]
    for s in manifest["shards"]:
        verify_shard(out, s)
    assert manifest["tokenizer"]["dtype"] == "uint16"
    # every document of the slice is accounted for: kept, dropped or quarantined, exactly once
    ids_in = [orjson.loads(line)["id"] for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
    kept_ids = [r["id"] for r in rows]
    dropped_ids = [r["id"] for r in dropped_rows(out)]
    assert sorted(kept_ids + dropped_ids) == sorted(ids_in)
    assert result.stats["inputs"][0]["balanced"]
    # domains come from each record's own `source` field
    assert set(manifest["domains"]) <= {"man", "license", "code"}
    assert "code" in manifest["domains"]


def test_shards_read_back_identically_with_pyarrow_polars_and_datasets(tmp_path, slice_input):
    out = tmp_path / "out"
    run(small_config(out, [slice_input]))
    files = [str(out / s["path"]) for s in read_manifest(out)["shards"]]
    expected = pa.concat_tables([pa.ipc.open_file(f).read_all() for f in files]).to_pylist()
    polars_rows = pl.concat([pl.read_ipc(f) for f in files]).to_dicts()
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("arrow", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert polars_rows == expected
    assert ds.to_list() == expected


def test_exact_dedup_is_global_and_first_in_input_order_wins(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    text = "def f():\n    return 1\n" * 5
    a.write_text(json.dumps({"id": "a1", "text": "x = 1\n" * 3}) + "\n" + json.dumps({"id": "a2", "text": text}) + "\n")
    # b's copy differs only by what normalization removes (CRLF, trailing blanks)
    b.write_text(json.dumps({"id": "b1", "text": text.replace("\n", "  \r\n")}) + "\n")
    out = tmp_path / "out"
    run(small_config(out, [{"path": str(b), "domain": "code"}, {"path": str(a), "domain": "code"}]))
    drops = {r["id"]: r for r in dropped_rows(out)}
    # b is listed first, so b1 wins and a2 is the duplicate (across two files and blocks)
    assert drops["a2"]["reason"] == "exact_duplicate" and drops["a2"]["kept_id"] == "b1"
    assert {r["id"] for r in shard_rows(out)} == {"b1", "a1"}


def test_disabling_exact_dedup_by_override(tmp_path, slice_input):
    out = tmp_path / "out"
    result = run(small_config(out, [slice_input], dedup={"exact": {"enabled": False}}))
    assert "exact_dedup" not in {f["stage"] for f in result.stats["funnel"]}


BAD_LINES = [
    b'{"id": "bad-json", "text": "unterminated',
    b'\xff\xfe not utf-8 at all',
    b'["a list", "not an object"]',
    b'{"id": "no-text"}',
    b'{"id": "num-text", "text": 42}',
    b'{"id": "empty", "text": "   "}',
    b'',  # a blank line: skipped silently, still a line
]


def test_bad_input_is_quarantined_and_every_valid_document_is_accounted_for(tmp_path):
    good = [orjson.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
    lines = []
    for i, rec in enumerate(good):
        lines.append(orjson.dumps(rec))
        if i < len(BAD_LINES):
            lines.append(BAD_LINES[i])
    lines.append(orjson.dumps(good[0]))  # an exact duplicate of a valid document, new id below
    lines[-1] = orjson.dumps({**good[0], "id": "dup-of-first"})
    raw = tmp_path / "mixed.jsonl.gz"
    raw.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    out = tmp_path / "out"
    result = run(small_config(out, [{"path": str(raw), "domain_field": "source"}]))

    q = quarantined(out)
    assert sorted(r["reason"] for r in q) == sorted(
        ["malformed_json", "invalid_utf8", "not_an_object", "missing_text", "text_not_string", "empty_text"]
    )
    assert all(r["file"] == str(raw) and r["line"] >= 1 for r in q)
    assert next(r for r in q if r["reason"] == "invalid_utf8")["line"] == 4  # good, bad-json, good, here
    kept = [r["id"] for r in shard_rows(out)]
    dropped = [r["id"] for r in dropped_rows(out)]
    valid = [r["id"] for r in good] + ["dup-of-first"]
    assert not set(kept) & set(dropped)
    assert sorted(kept + dropped) == sorted(valid)
    row = result.stats["inputs"][0]
    assert row["balanced"] and row["read"] == len(lines) - 1  # the blank line is no record
    assert row["read"] == row["kept"] + sum(sum(r.values()) for r in row["dropped"].values()) + sum(row["quarantined"].values())
    assert result.stats["quarantined"]["malformed_json"] == 1


def test_config_errors_before_any_work(tmp_path, slice_input):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="does-not-exist"):
        run(small_config(out, [{"path": str(tmp_path / "does-not-exist.jsonl")}]))
    assert not out.exists()
    tok = tmp_path / "tok.json"
    from stages.tokenize import TokenizerConfig, train_tokenizer

    train_tokenizer(["hello world"] * 10, TokenizerConfig(eos_token="<eos>")).save(str(tok))
    with pytest.raises(ConfigError, match="eos_token '<\\|endoftext\\|>' is not in the vocabulary"):
        run(small_config(out, [slice_input], tokenizer={"path": str(tok)}))


def test_existing_tokenizer_is_used_and_its_eos_appended(tmp_path, slice_input):
    from stages.tokenize import TokenizerConfig, train_tokenizer

    tok = tmp_path / "tok.json"
    train_tokenizer(["some text for a tiny vocabulary"] * 20, TokenizerConfig(eos_token="<eos>")).save(str(tok))
    out = tmp_path / "out"
    run(small_config(out, [slice_input], tokenizer={"path": str(tok), "eos_token": "<eos>"}))
    m = read_manifest(out)
    assert m["tokenizer"]["path"] == str(tok) and m["tokenizer"]["eos_id"] == 0
    assert all(r["tokens"][-1] == 0 for r in shard_rows(out))


def test_a_tokenizer_with_an_eos_id_beyond_its_token_count(tmp_path, slice_input):
    """EOS at id 70,000 in a 2,048-token vocabulary: the shards are uint32 and the manifest's vocabulary
    size is 70,001, so a model sized from it has a row for the EOS (it used to crash at tokenize)."""
    from helpers import with_eos_at

    path = tmp_path / "tokenizer.json"
    path.write_text(with_eos_at((Path(__file__).parents[2] / "tokenizers" / "quickstart" / "tokenizer.json").read_text(), 70_000))
    out = tmp_path / "out"
    run(small_config(out, [slice_input], tokenizer={"path": str(path)}))
    tokenizer = read_manifest(out)["tokenizer"]
    assert (tokenizer["vocab_size"], tokenizer["dtype"], tokenizer["eos_id"]) == (70_001, "uint32", 70_000)
    rows = shard_rows(out)
    assert rows and all(r["tokens"][-1] == 70_000 for r in rows)


def test_output_made_with_another_config_is_refused(tmp_path, slice_input):
    out = tmp_path / "out"
    run(small_config(out, [slice_input]))
    again = run(small_config(out, [slice_input]))  # same config: already complete, same manifest
    assert again.manifest == read_manifest(out)
    with pytest.raises(RunConflict, match=r"normalize.unicode_form: 'NFC' -> 'NFKC'"):
        run(small_config(out, [slice_input], normalize={"unicode_form": "NFKC"}))




@pytest.mark.parametrize("crash_after", [0, 5, 12])
def test_interrupted_run_resumes_to_identical_shards(tmp_path, slice_input, crash_after):
    tiny_blocks = {"block_bytes": 1024}  # about one document per block: many tasks to be killed among
    ref = tmp_path / "ref"
    run(small_config(ref, [slice_input], read=tiny_blocks), extra_stages=[PassThrough()])
    out = tmp_path / "out"
    cfg = small_config(out, [slice_input], read=tiny_blocks)
    with pytest.raises(_Interrupt):
        run(cfg, extra_stages=[CrashAfter(crash_after)])
    assert not (out / "manifest.json").exists()
    run(cfg, extra_stages=[PassThrough()])
    assert checksums(out) == checksums(ref)
    assert read_manifest(out) == read_manifest(ref)


def test_killed_process_resumes_to_identical_shards(tmp_path):
    """SIGKILL a real `datapipe curate` at some point after it has started writing, rerun it."""
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(
        f"inputs: [{{path: '{ASSETS / 'corpus_slice.jsonl'}', domain_field: source}}]\n"
        "read: {block_bytes: 2048, batch_size: 4}\n"
        "filters: {code: {code: {}}}\n"
        "tokenizer: {train: {vocab_size: 600}}\n"
        "output: {shard_bytes: 4096}\n"
    )
    cmd = [sys.executable, "-m", "datapipe", "curate", str(cfg_file), "--executor", "local", "--no-progress"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run(cmd + ["--output", str(ref)], check=True, capture_output=True)
    proc = subprocess.Popen(cmd + ["--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list((out / "work").glob("seg*/*.json"))) < 3:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    subprocess.run(cmd + ["--output", str(out)], check=True, capture_output=True)
    assert checksums(out) == checksums(ref)


def test_tokenizer_trains_on_a_deterministic_sample(tmp_path, slice_input):
    sample = {"train": {"vocab_size": 400, "sample_bytes": 20_000}}  # well under the slice's kept text
    run(small_config(tmp_path / "a", [slice_input], tokenizer=sample))
    run(small_config(tmp_path / "b", [slice_input], tokenizer=sample))
    full = run(small_config(tmp_path / "c", [slice_input]))
    a = (tmp_path / "a" / "tokenizer.json").read_text()
    assert a == (tmp_path / "b" / "tokenizer.json").read_text()
    assert a != (tmp_path / "c" / "tokenizer.json").read_text()  # the sample really is a subset
    assert checksums(tmp_path / "a") == checksums(tmp_path / "b")
    assert full.manifest["total_docs"] == read_manifest(tmp_path / "a")["total_docs"]


class _DriverReads(LocalExecutor):
    """Runs tasks in this process and records every table the driver itself (outside a task) reads."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.in_task = False
        self.driver_reads: list[str] = []
        import datapipe.core.workfiles as workfiles
        from datapipe.curation import losers
        from datapipe.curation.phases import eval_split, near_dedup, selection, unique_ids
        from datapipe.curation.phases import shards

        real = workfiles.read_work_table

        def spy(path):
            if not self.in_task:
                self.driver_reads.append(str(path))
            return real(path)

        for module in (losers, shards, selection, eval_split, near_dedup, unique_ids):
            monkeypatch.setattr(module, "read_work_table", spy)
        import datapipe.core.shuffle as shuffle
        real_shuffle = shuffle.read_shuffle

        def spy_shuffle(paths, *args, **kwargs):
            if not self.in_task:
                self.driver_reads.extend(str(p) for p in paths)
            return real_shuffle(paths, *args, **kwargs)

        import datapipe.core.exchange as exchange
        for module in (shuffle, exchange):  # the rest read through the exchange (Shuffle, Combined, SenderFiles)
            monkeypatch.setattr(module, "read_shuffle", spy_shuffle)

    def run_tasks(self, fn, shared, items, desc, **kwargs):
        self.in_task = True
        try:
            return super().run_tasks(fn, shared, items, desc)
        finally:
            self.in_task = False


def test_the_driver_reads_no_document_table(tmp_path, slice_input, monkeypatch):
    """Memory bounded by blocks and partitions, not by the corpus: every per-document decision (global
    stages' losers, near-dedup clusters, the tokenizer's sample, the eval split, diversity sampling, the mixture) is made in
    tasks; the driver only adds up the tasks' per-block summaries. (Before, it read every token block,
    every loser and every cluster member, and then every block's lengths and histogram files.)"""
    cfg = small_config(tmp_path / "out", [slice_input],
                       dedup={"exact": {"enabled": True}, "minhash": {"enabled": True, "partitions": 3}},
                       eval={"enabled": True, "fraction": 0.2, "max_tokens_per_domain": 3000},
                       diversity={"enabled": True, "domains": {"man": 0.5}, "clusters": 2},
                       mixture={"enabled": True}, output={"keep_work": True})
    executor = _DriverReads(monkeypatch)
    result = curate(cfg, executor=executor, progress=False, log=lambda _: None)
    assert result.stats["eval"]["domains"] and result.stats["diversity"]["man"]["docs_kept"] > 0
    work = tmp_path / "out" / "work"
    read = {os.path.relpath(p, work) for p in executor.driver_reads}
    # No file at all, work table or shuffle file: shard planning's sums and cuts, diversity's histogram sums run in
    # tasks over groups of blocks (the driver adds up one number per block); the eval split's candidates, chosen
    # documents and near copies stay in tasks. (Before: every block's lengths, copies, eval row marks and
    # histogram, one file at a time; the eval candidates and near-copy edges.)
    assert read == set()


def test_ray_stall_timeout_is_a_checked_key_that_reaches_the_executor(tmp_path, slice_input, monkeypatch):
    from datapipe.curation import start as runner  # where the run starts its executor

    assert small_config(tmp_path / "o", [slice_input]).ray.stall_timeout_s == 600
    with pytest.raises(ConfigError, match=r"stall_timeout_s must be >= 0 \(0 = no limit\), got -1"):
        small_config(tmp_path / "o", [slice_input], ray={"stall_timeout_s": -1})
    seen = {}

    def make_executor(kind, address, **kwargs):
        seen.update(kwargs)
        return LocalExecutor()

    monkeypatch.setattr(runner, "make_executor", make_executor)  # curate without an executor starts Ray's
    curate(small_config(tmp_path / "out", [slice_input], ray={"stall_timeout_s": 7}), progress=False, log=lambda _: None)
    assert seen["stall_timeout_s"] == 7


def test_a_resumed_run_says_how_much_work_it_reused(tmp_path, slice_input):
    tiny_blocks = {"block_bytes": 1024}
    out = tmp_path / "out"
    cfg = small_config(out, [slice_input], read=tiny_blocks)
    with pytest.raises(_Interrupt):
        run(cfg, extra_stages=[CrashAfter(5)])
    # the records of the killed run: its one read task, all of the first segment's blocks, some of the second's
    seg0, seg1 = (len(list((out / "work" / seg).glob("*.json"))) for seg in ("seg0", "seg1"))
    assert seg0 > seg1 > 0
    lines: list[str] = []
    result = curate(cfg, executor=LocalExecutor(), progress=False, log=lines.append, extra_stages=[PassThrough()])
    (line,) = [x for x in lines if x.startswith("resumed: ")]
    # by user-level stage: read (its units and the id partitions), exact dedup (its blocks, resolve and routing), ...
    found = re.fullmatch(r"resumed: (\d+) of \d+ tasks were already done \(read (\d+)/\2, exact dedup (\d+)/\3, "
                         rf"filters \+ crash {seg1}/{seg0}, tokenize 0/(\d+), shards 0/\d+\)", line)
    assert found, line
    # the tokenizer's sample (a task a block; the one training task reads their files: no combine), a tokenize task a block
    assert int(found[4]) == seg0 + 1 + seg0
    # one unit, the ids' combine task and 3 id partitions; the blocks and the resolve
    assert int(found[2]) == 1 + 1 + 3 and int(found[3]) > seg0
    assert result.resumed_tasks == int(found[1]) == int(found[2]) + int(found[3]) + seg1
    fresh: list[str] = []
    curate(small_config(tmp_path / "fresh", [slice_input]), executor=LocalExecutor(), progress=False, log=fresh.append)
    assert not any(x.startswith("resumed") for x in fresh)  # a fresh run lists nothing and says nothing


def test_keep_dropped_text_keeps_the_text_of_language_id_and_eval_split_drops(tmp_path):
    english = [orjson.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
    other = [r for r in map(orjson.loads, (ASSETS / "multilingual_sample.jsonl").read_bytes().splitlines())
             if r["lang"] not in ("en", "python")]
    docs = [{"id": f"d{i}", "text": r["text"]} for i, r in enumerate(english + other)]
    # with dedup off, a copy under another id is dropped by the eval split when one of the two is held out
    docs += [{"id": f"copy-of-d{i}", "text": r["text"]} for i, r in enumerate(english)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    out = tmp_path / "out"
    run(small_config(out, [{"path": str(path)}], filters={}, langid={"enabled": True, "keep": ["en"]},
                     dedup={"exact": {"enabled": False}, "minhash": {"enabled": False}},
                     eval={"enabled": True, "fraction": 0.5}, output={"keep_dropped_text": True}))
    texts = {d["id"]: d["text"] for d in docs}
    dropped = dropped_rows(out)
    for stage in ("langid", "eval_split"):
        rows = [r for r in dropped if r["stage"] == stage]
        assert rows, f"no {stage} drop: the test would check nothing"
        # the text as curated (normalized: line ends and trailing blanks), not null
        assert all(r["text"] is not None and r["text"].split() == texts[r["id"]].split() for r in rows), stage


def test_losers_gathered_by_unit_group_are_the_same_whatever_the_grouping(tmp_path, monkeypatch):
    """Five input files with copies across them: each block reads its unit's losers from its group's one
    file (`gather_losers_task`); groups of 2 units and one unit each drop exactly the same documents."""
    from datapipe.curation import losers

    texts = [f"document {i} " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(60)) for i in range(12)]
    for f in range(5):
        rows = [{"id": f"f{f}-{i}", "text": texts[(f * 3 + i) % 12]} for i in range(8)]  # repeats across files
        (tmp_path / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for groups in (2, 256):
        monkeypatch.setattr(losers, "UNIT_GROUPS", groups)
        cfg = small_config(tmp_path / f"g{groups}", [{"path": str(tmp_path / "part-*.jsonl"), "domain": "web"}], filters={},
                           dedup={"exact": {"enabled": True}, "minhash": {"enabled": True}})
        outputs[groups] = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert outputs[2].stats["dropped"] == outputs[256].stats["dropped"] and outputs[2].stats["dropped"]["exact_dedup"]
    assert [s["sha256"] for s in outputs[2].manifest["shards"]] == [s["sha256"] for s in outputs[256].manifest["shards"]]


def test_the_driver_reads_while_ray_starts_and_the_output_is_the_same(tmp_path, monkeypatch):
    """While an embedded Ray starts, the driver reads the first input units itself (`EarlyReader`); Ray's tasks
    read the rest. The output is the one an executor that read every unit gives, and no reading thread
    outlives the run."""
    import threading

    from datapipe.curation import start as runner  # where the run starts its executor

    lines = (ASSETS / "corpus_slice.jsonl").read_text().splitlines(keepends=True)
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(6):  # six files: six read units
        (folder / f"part-{i}.jsonl").write_text("".join(lines[i::6]))
    inputs = [{"path": str(folder), "domain_field": "source"}]
    run(small_config(tmp_path / "ref", inputs))

    read_by_ray: list[int] = []

    class SlowToStart(LocalExecutor):  # Ray's start, slow enough that the driver reads some units meanwhile
        def run_tasks(self, fn, shared, items, desc, **kw):
            if desc == "read":
                read_by_ray.extend(u for (u,) in items)
            return super().run_tasks(fn, shared, items, desc, **kw)

    def make_executor(kind, address, **kwargs):
        deadline = time.monotonic() + 30
        while not list((tmp_path / "out" / "work" / "read").glob("u000001.json")) and time.monotonic() < deadline:
            time.sleep(0.01)  # "Ray starts" until the driver has read two units
        return SlowToStart()

    monkeypatch.setattr(runner, "make_executor", make_executor)
    monkeypatch.setattr(runner, "ray_is_running", lambda: False)
    result = curate(small_config(tmp_path / "out", inputs), progress=False, log=lambda _: None)
    assert result.resumed_tasks == 0  # what the driver read is this run's work, not a resumed run's
    assert read_by_ray and read_by_ray[0] >= 2 and read_by_ray == list(range(read_by_ray[0], 6))  # the rest, in order
    assert checksums(tmp_path / "out") == checksums(tmp_path / "ref")
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["inputs"] == \
        json.loads((tmp_path / "ref" / "stats.json").read_text())["inputs"]
    assert not [t for t in threading.enumerate() if t.name == "datapipe-early-read"]


def test_a_read_error_in_the_driver_is_the_runs_error(tmp_path, slice_input, monkeypatch):
    from datapipe.curation import start as runner  # where the run starts its executor

    def read_task(plan, unit):
        raise ConfigError("inputs[0].path: cannot be read now")

    monkeypatch.setattr(runner, "read_task", read_task)  # the driver's early read
    monkeypatch.setattr(runner, "make_executor", lambda kind, address, **kw: (time.sleep(0.2), LocalExecutor())[1])
    monkeypatch.setattr(runner, "ray_is_running", lambda: False)
    with pytest.raises(ConfigError, match="cannot be read now"):
        curate(small_config(tmp_path / "out", [slice_input]), progress=False, log=lambda _: None)


def test_a_block_write_that_fails_on_the_writer_thread_fails_the_read(tmp_path, monkeypatch):
    """The read task writes block k on a second thread while it parses block k+1: a write that fails there (a
    full disk) is the task's error, and the unit is not marked done."""
    from datapipe.curation.phases import read

    written = read._write_block

    def fail_on_the_second(plan, name, table, input_index):
        if name.endswith("b00001"):
            raise ConfigError("output.dir: the disk is full")
        return written(plan, name, table, input_index)

    monkeypatch.setattr(read, "_write_block", fail_on_the_second)
    with pytest.raises(ConfigError, match="the disk is full"):
        run(small_config(tmp_path / "out", [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}]))
    assert (tmp_path / "out" / "work" / "read" / "u000000-b00000.arrow").exists()  # the block before it was written
    assert not (tmp_path / "out" / "work" / "read" / "u000000.json").exists()


def test_an_interrupt_while_ray_starts_does_not_wait_for_the_drivers_read(tmp_path, slice_input, monkeypatch):
    import threading

    from datapipe.curation import start as runner  # where the run starts its executor

    release = threading.Event()
    monkeypatch.setattr(runner, "read_task", lambda plan, unit: release.wait(60))  # the driver's early read: a minute

    def interrupted_while_starting(kind, address, **kwargs):
        time.sleep(0.2)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "make_executor", interrupted_while_starting)
    monkeypatch.setattr(runner, "ray_is_running", lambda: False)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            curate(small_config(tmp_path / "out", [slice_input]), progress=False, log=lambda _: None)
        assert time.monotonic() - start < 10  # ^C is not held up by the unit the driver is reading
    finally:
        release.set()
