"""Input and output faults end to end (LocalExecutor): a damaged compressed input among good ones,
a full or read-only disk, temporaries and work/ left behind, duplicate ids, and a run where nothing
survives."""

from __future__ import annotations

import errno
import gzip
import json
import random
import shutil
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
import zstandard

from helpers import (CrashAfter, Interrupted, PassThrough, damage, gzip_member_with_a_flipped_bit, killed_mid_write, small_config,
                     zstd_frame_with_a_flipped_bit)
from datapipe import cli
from datapipe.core import shards
from datapipe.core.config import RunStopped
from datapipe.core.shards import OutputError, open_shard, read_manifest
from datapipe.curation.executors import LocalExecutor
from datapipe.curation import steps as run_module  # the run's steps: the tasks each phase launches
from datapipe import curate
from datapipe.inspect import stats as inspect_stats


def run(cfg, **kw):
    return curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None, **kw)


def docs(prefix: str, n: int, seed: int = 0) -> list[dict]:
    """Distinct documents of plain words that survive the default stages."""
    rng = random.Random(seed)
    words = ["river", "stone", "light", "paper", "garden", "window", "silver", "morning", "letter", "field"]
    return [{"id": f"{prefix}{i}", "text": " ".join(rng.choice(words) for _ in range(30)) + f" {prefix}{i}."} for i in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def shard_ids(out: Path) -> list[str]:
    return [r["id"] for s in read_manifest(out)["shards"] for r in open_shard(out, s["path"]).select(["id"]).to_pylist()]


def checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]]


def leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if shards.TEMP_MARK in p.name)


# ------------------------------------------------------------------------------ a damaged input


def test_a_cut_gzip_among_good_inputs_is_quarantined_and_the_run_finishes(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", docs("g", 300))
    rng = random.Random(1)  # random text compresses little: the cut lands well inside the file
    lines = b"".join(orjson.dumps({"id": f"c{i}", "text": rng.randbytes(60).hex()}) + b"\n" for i in range(1500))
    blob = gzip.compress(lines)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    out = tmp_path / "out"
    result = run(small_config(out, [{"path": str(cut)}, {"path": str(good)}]))

    ids = shard_ids(out)
    assert {f"g{i}" for i in range(300)} <= set(ids)  # every document of the good input is written
    (damaged,) = result.stats["damaged_inputs"]
    assert damaged["file"] == str(cut) and damaged["input"] == 0
    read_before = damaged["last_good_line"]
    assert 0 < read_before < 1500 and "cannot decompress past line" in damaged["detail"]
    assert sum(i.startswith("c") for i in ids) == read_before  # the lines before the damage are kept
    cut_row = result.stats["inputs"][0]
    assert cut_row["quarantined"] == {"truncated_input": 1} and cut_row["balanced"]
    assert cut_row["read"] == read_before + 1  # read = kept + dropped + quarantined, the rest as one record
    assert result.stats["quarantined"]["truncated_input"] == 1


def test_a_bit_flip_in_a_member_puts_none_of_its_records_into_the_shards(tmp_path: Path) -> None:
    def jsonl(records: list[dict]) -> bytes:
        return b"".join(orjson.dumps(r) + b"\n" for r in records)

    def frame(records: list[dict]) -> bytes:
        return zstandard.ZstdCompressor(write_checksum=True).compress(jsonl(records))

    gz_docs, zst_docs = docs("z", 300, seed=1), docs("s", 300, seed=2)
    gz = tmp_path / "members.jsonl.gz"  # three gzip members, the middle one with a flipped bit that zlib inflates
    gz.write_bytes(gzip.compress(jsonl(gz_docs[:100])) + gzip_member_with_a_flipped_bit(jsonl(gz_docs[100:200]))
                   + gzip.compress(jsonl(gz_docs[200:])))
    zst = tmp_path / "frames.jsonl.zst"  # three zstd frames with checksums, the middle one with a flipped bit
    zst.write_bytes(frame(zst_docs[:100]) + zstd_frame_with_a_flipped_bit(jsonl(zst_docs[100:200]))
                    + frame(zst_docs[200:]))
    good = write_jsonl(tmp_path / "good.jsonl", docs("g", 100))
    out = tmp_path / "out"
    result = run(small_config(out, [{"path": str(gz)}, {"path": str(zst)}, {"path": str(good)}]))

    intact = gz_docs[:100] + gz_docs[200:] + zst_docs[:100] + zst_docs[200:]
    # The intact members' records, every one, and nothing of a damaged member, garbled or not.
    assert sorted(shard_ids(out)) == sorted([d["id"] for d in intact] + [f"g{i}" for i in range(100)])
    gz_row, zst_row, good_row = result.stats["inputs"]
    assert gz_row["quarantined"] == {"corrupt_input": 100} and gz_row["read"] == 300  # one record per line of it
    assert list(zst_row["quarantined"]) == ["corrupt_input"]
    assert zst_row["read"] == 200 + zst_row["quarantined"]["corrupt_input"]
    assert all(row["balanced"] for row in result.stats["inputs"])  # read = kept + dropped + quarantined
    assert result.stats["quarantined"] == {"corrupt_input": 100 + zst_row["quarantined"]["corrupt_input"]}
    damaged = {d["file"]: d for d in result.stats["damaged_inputs"]}
    assert sorted(damaged) == sorted([str(gz), str(zst)])
    assert damaged[str(gz)]["last_good_line"] == 100 and damaged[str(gz)]["quarantined"] == {"corrupt_input": 100}
    assert damaged[str(gz)]["detail"].startswith("the gzip member holding lines 101-200 fails its check")
    assert damaged[str(zst)]["last_good_line"] == 100 and "the zstd frame " in damaged[str(zst)]["detail"]


# ------------------------------------------------------------------------- a full or read-only disk


def _full_disk_on(monkeypatch: pytest.MonkeyPatch, part: str, after: int, code: int = errno.ENOSPC) -> list[str]:
    """Make the (`after`+1)-th Arrow file written under a path containing `part` fail like a full
    disk would: the temporary file is created, then the write raises OSError(code)."""
    real = pa.OSFile
    seen: list[str] = []

    def failing(path, mode="r"):
        if "w" in mode and part in str(path):
            seen.append(str(path))
            if len(seen) > after:
                real(path, mode).close()  # the half-written temporary a real full disk leaves
                raise OSError(code, f"{errno.errorcode[code]}: {__import__('os').strerror(code)}")
        return real(path, mode)

    monkeypatch.setattr(pa, "OSFile", failing)
    return seen


def test_a_full_disk_in_the_shard_phase_is_one_clear_error_and_the_rerun_is_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", docs("d", 200))
    ref = tmp_path / "ref"
    run(small_config(ref, [{"path": str(data)}]))
    out = tmp_path / "out"
    cfg = small_config(out, [{"path": str(data)}])
    _full_disk_on(monkeypatch, "/shards/", after=1)
    with pytest.raises(OutputError) as info:
        run(cfg)
    message = str(info.value)
    assert f"cannot write {out}/shards/shard-00001.arrow: no space left on the device" in message
    assert "free space there" in message and "run the same command again" in message
    assert leftovers(out) == []  # the failed write removed its temporary file
    assert not (out / "manifest.json").exists()

    monkeypatch.undo()  # space freed
    stale = [out / "shards" / ".shard-00002.arrow.tmp-4242-0badc0de", out / "work" / "read" / ".u000000.json.tmp-4242-deadbeef"]
    for path in stale:  # what a SIGKILL in the middle of a write leaves
        path.write_bytes(b"half")
    run(cfg)
    assert checksums(out) == checksums(ref)
    assert leftovers(out) == []
    assert not (out / "work").exists()


def test_a_read_only_output_fails_through_the_cli_with_the_path_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Tests run as root, which ignores permission bits: the read-only file system is simulated in
    # the one place every output file is opened.
    data = write_jsonl(tmp_path / "data.jsonl", docs("d", 20))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"inputs: [{{path: '{data}'}}]\ntokenizer: {{train: {{vocab_size: 300}}}}\n")
    out = tmp_path / "out"

    def read_only(path, mode="r", *args, **kwargs):
        if "w" in mode or "+" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(shards, "open", read_only, raising=False)
    code = cli.main(["curate", str(cfg), "--output", str(out), "--executor", "local", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"cannot write {out}/run.json: the file system is read-only" in err
    assert "choose a writable output folder" in err and "Traceback" not in err


def test_a_user_error_in_a_ray_task_surfaces_as_itself(ray_local, tmp_path: Path) -> None:
    from datapipe.curation.executors import RayExecutor

    (tmp_path / "file").write_text("a file where a folder should go")
    executor = RayExecutor(progress=False)
    with pytest.raises(OutputError, match=r"^cannot write .*/file/sub: ") as info:
        executor.run_tasks(shards.make_folder, str(tmp_path / "file" / "sub"), [()], "t")
    assert "Traceback" not in str(info.value) and "RayTaskError" not in str(info.value)


# ------------------------------------------------------------------------------------- temporaries

# Writes through the writer every output goes through (`replacing`: a temporary name, renamed when complete),
# prints the temporary's path mid-write and waits there to be killed.
WRITER = r"""
import sys, time
from datapipe.core.shards import replacing
with replacing(sys.argv[1], True) as tmp, open(tmp, "wb") as f:
    f.write(b"half a shard " * 100_000)
    f.flush()
    print(tmp, flush=True)
    time.sleep(600)
"""


def test_a_writer_killed_during_the_run_leaves_no_temporary_in_the_finished_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", docs("d", 200))
    out = tmp_path / "out"
    killed: list[Path] = []
    real = run_module.shard_task

    def shard_task(plan, index, *args):
        if index == 0 and not killed:  # a Ray worker writing shard 0 is SIGKILLed; the retried task writes it
            killed.append(Path(killed_mid_write(WRITER, str(out / "shards" / "shard-00000.arrow"))))
        return real(plan, index, *args)

    monkeypatch.setattr(run_module, "shard_task", shard_task)
    run(small_config(out, [{"path": str(data)}]))
    assert killed and killed[0].name.startswith(".shard-00000.arrow.tmp-")  # what the kill left, during the run
    assert leftovers(out) == []  # gone before the manifest: a successful run leaves only its outputs
    assert (out / "manifest.json").exists() and shard_ids(out)


# ------------------------------------------------------------------------------------- work/


def test_work_left_by_a_kill_after_the_manifest_goes_on_resume(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", docs("d", 20))
    out = tmp_path / "out"
    cfg = small_config(out, [{"path": str(data)}])
    run(cfg)
    (out / "work" / "tokens").mkdir(parents=True)  # killed between the manifest and the clean-up
    (out / "work" / "tokens" / "u000000-b00000.arrow").write_bytes(b"x" * 1000)
    run(cfg)  # already complete: nothing to do but the clean-up
    assert not (out / "work").exists()


# ------------------------------------------------------------------------------ duplicate ids


def test_duplicate_ids_are_renamed_in_input_order(tmp_path: Path) -> None:
    a1, a2, a3, b = (d["text"] for d in docs("t", 4))
    first = write_jsonl(tmp_path / "1.jsonl", [
        {"id": "a", "text": a1}, {"id": "a#2", "text": a2}, {"id": "a", "text": a3}])
    second = write_jsonl(tmp_path / "2.jsonl", [
        {"id": "a", "text": a1},  # same id and text as the first: an exact duplicate
        {"id": "b", "text": b}, {"id": "a#2", "text": b + " more"}])
    results = {}
    for partitions in (1, 3):  # ids do not depend on how the work is cut
        out = tmp_path / f"out{partitions}"
        results[partitions] = run(small_config(out, [{"path": str(first)}, {"path": str(second)}],
                                               dedup={"exact": {"partitions": partitions}}))
        # a: first keeps it; the 2nd a skips a#2 (an input id) to a#3; the 3rd a is a#4; the 2nd a#2 is a#2#2
        assert shard_ids(out) == ["a", "a#2", "a#3", "b", "a#2#2"]
        why = inspect_stats.why(out, "a#4")
        assert why["status"] == "dropped" and why["reason"] == "exact_duplicate" and why["kept_id"] == "a"
        assert inspect_stats.why(out, "a#3")["status"] == "kept"
    dup = results[1].stats["duplicate_ids"]
    assert dup["renamed"] == 3 and dup == results[3].stats["duplicate_ids"]
    assert dup["examples"] == [{"id": "a", "renamed_to": "a#3"}, {"id": "a", "renamed_to": "a#4"},
                               {"id": "a#2", "renamed_to": "a#2#2"}]


# ------------------------------------------------------------------------- nothing survives


# Every phase that can run is on: each must handle zero blocks and zero documents.
EVERY_SWITCH = ("dedup: {exact: {enabled: true}, minhash: {enabled: true}}\nlangid: {enabled: true}\n"
                "eval: {enabled: true, fraction: 0.1}\ndiversity: {enabled: true, domains: {default: 0.5}}\n"
                "mixture: {enabled: true}\ntokenizer: {train: {vocab_size: 300}}\n")


@pytest.mark.parametrize("case", ["empty", "all_bad", "all_filtered", "flipped_gzip"])
def test_nothing_surviving_is_a_clear_message_with_stats(tmp_path: Path, case: str, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data.jsonl"
    filters = "{}"
    if case == "empty":
        data.write_bytes(b"")
    elif case == "all_bad":
        data.write_bytes(b'not json\n{"text": ""}\n{"id": 3}\n')
    elif case == "flipped_gzip":  # a single damaged member: every line is set aside as corrupt_input
        data = tmp_path / "data.jsonl.gz"
        data.write_bytes(gzip_member_with_a_flipped_bit(b"".join(orjson.dumps(d) + b"\n" for d in docs("d", 40))))
    else:
        write_jsonl(data, docs("d", 10))
        filters = "{'*': {gopher_quality: {min_doc_words: 100000}}}"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"inputs: [{{path: '{data}'}}]\nfilters: {filters}\n{EVERY_SWITCH}")
    out = tmp_path / "out"
    code = cli.main(["curate", str(cfg), "--output", str(out), "--executor", "local", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "no document survived curation" in err and f"datapipe stats {out}" in err
    expected = {"empty": "0 records read from 1 input(s)",
                "all_bad": "3 quarantined while reading (",
                "all_filtered": "10 dropped by filters (gopher_quality:word_count 10)",
                "flipped_gzip": "40 quarantined while reading (corrupt_input 40)"}[case]
    assert expected in err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["nothing_survived"] and all(row["balanced"] for row in stats["inputs"])
    assert not (out / "manifest.json").exists() and not (out / "work").exists()
    figures = inspect_stats.collect(out)  # `datapipe stats` can show why
    assert figures["summary"]["docs"] == 0 and not figures["complete"]
    # a rerun says the same, it does not trip over the folder the first run left
    assert cli.main(["curate", str(cfg), "--output", str(out), "--executor", "local", "--no-progress"]) == 1
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("how", ["cut", "deleted", "eval manifest"])
def test_a_finished_folder_with_a_damaged_shard_is_not_reused_and_the_recovery_it_names_works(tmp_path: Path, slice_input,
                                                                                         how: str) -> None:
    out = tmp_path / "out"
    cfg = small_config(out, [slice_input], eval={"enabled": True, "fraction": 0.2})
    run(cfg)
    reference = checksums(out)
    shard = out / read_manifest(out)["shards"][1]["path"]
    damage(out / "eval" / "manifest.json" if how == "eval manifest" else shard, "cut" if how == "eval manifest" else how)
    with pytest.raises(RunStopped) as stopped:
        run(cfg)
    message = str(stopped.value)
    expected = {"cut": f"{shard} holds", "deleted": f"{shard} is missing",
                "eval manifest": "eval/manifest.json cannot be read"}[how]
    assert f"holds a finished run of this config, but {expected}" in message and f"rm -r {out} and run the same" in message
    shutil.rmtree(out)  # the recovery it names
    run(cfg)
    assert checksums(out) == reference


# ------------------------------------------------------------------------- damaged work files


# What the resumed run reads, written before the kill: the exact-dedup keys combined (the run killed before their
# resolve; the senders' own files are gone once combined), the exact-dedup losers by unit, a segment's view of a
# block, a read block's text, a task's record.
DAMAGED = {
    "exact keys": "exact_dedup/keys/combined-00000.shuffle",
    "losers by unit": "exact_dedup/losers-by-unit/g00000.shuffle",
    "view": "seg0/u000000-b00001.arrow",
    "read block": "read/u000000-b00001.arrow",
    "record": "seg0/u000000-b00001.json",
}


# one bit in every kind of work file; cut and emptied in a shuffle file, a table and a record
CASES = [(target, "bit") for target in sorted(DAMAGED)] + [(t, how) for t in ("exact keys", "view", "record")
                                                          for how in ("cut", "emptied")]


@pytest.mark.parametrize(("target", "how"), CASES)
def test_a_damaged_work_file_is_redone_or_named_never_read_wrong(tmp_path: Path, slice_input, how: str, target: str,
                                                              monkeypatch) -> None:
    from datapipe.core import exchange

    monkeypatch.setattr(exchange, "RECEIVER_FILES", 1)  # a small run's keys combined, as a large run's are
    ref = tmp_path / "ref"
    run(small_config(ref, [slice_input]), extra_stages=[PassThrough()])
    out = tmp_path / "out"
    cfg = small_config(out, [slice_input])
    with pytest.raises(Interrupted):
        run(cfg, extra_stages=[CrashAfter(0)])
    work = out / "work"
    if target == "exact keys":  # as if killed right after the keys were sent: the resolve has not read them yet
        for done in work.glob("exact_dedup/losers-t*"):
            done.unlink()
        shutil.rmtree(work / "exact_dedup" / "losers-by-unit")
    damaged = work / DAMAGED[target]
    damage(damaged, how)
    stopped = False
    try:
        run(cfg, extra_stages=[PassThrough()])
    except RunStopped as exc:  # the CLI prints this as one paragraph, exit 1
        message, stopped = str(exc), True
        assert target != "record"  # a damaged record only means its task runs again
        assert f"work file {damaged} is damaged" in message and f"rm -r {work}" in message
        shutil.rmtree(work)  # the recovery it names
        run(cfg, extra_stages=[PassThrough()])
    assert stopped or target == "record"  # the damaged file was read (a resolve that was done would not read it)
    assert checksums(out) == checksums(ref)
    assert read_manifest(out)["total_tokens"] == read_manifest(ref)["total_tokens"]


def test_the_errors_a_task_raises_to_the_user_pickle_as_themselves() -> None:
    # What a Ray task raises reaches the driver pickled: one that cannot be rebuilt from its pickle arrives as Ray's
    # UnserializableException with the worker's stack, and its paragraph is lost.
    import pickle

    from datapipe.core.workfiles import DamagedWorkFile
    from datapipe.curation.readers.common import InputError
    from datapipe.curation.report import NothingSurvived

    for error in (DamagedWorkFile("/out/work/read/u000000-b00000.arrow", "it is missing"), NothingSurvived("none"),
                  InputError("input"), OutputError("disk full"), RunStopped("stopped")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
    damaged = pickle.loads(pickle.dumps(DamagedWorkFile("/out/work/x.arrow", "cut")))
    assert (damaged.path, damaged.problem) == ("/out/work/x.arrow", "cut")
