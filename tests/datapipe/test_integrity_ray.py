"""Damaged work files on the Ray executor: whatever file of a killed run is damaged (cut, emptied, one flipped bit,
deleted), the resume on Ray gives the same shards or stops with the one paragraph (the file, what is wrong, the
command that recovers), never a worker's traceback, and that recovery gives the same shards.

Built for cost: the module has one reference run and one killed run (every switch on, duplicate ids, killed in the
shards phase: every kind of work file is there), both on the local executor (they write the same files Ray's tasks
do). A case damages one file of a copy of the killed folder and removes the task records written after that file's
own task's record, as if the run had been killed right after that task: the resume then reads the file."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import orjson
import pytest

import helpers
from helpers import STALL_S, Interrupted, small_config
from datapipe.core.config import ConfigError, RunStopped
from datapipe.core.shards import read_manifest
from datapipe.curation import steps as run_module  # the run's steps: the tasks each phase launches
from datapipe.curation.executors import LocalExecutor, RayExecutor
from datapipe import curate


def _config(out: Path, inputs: list[dict]):
    return small_config(out, inputs, read={"block_bytes": 16384},
                        dedup={"exact": {"enabled": True, "partitions": 2},
                               "minhash": {"enabled": True, "partitions": 2}},
                        eval={"enabled": True, "fraction": 0.2, "max_tokens_per_domain": 3000},
                        diversity={"enabled": True, "domains": {"man": 0.5}, "clusters": 2},
                        mixture={"enabled": True}, selection={"method": "random", "keep_fraction": 0.8})


def _run(cfg, executor):
    return curate(cfg, executor=executor, progress=False, log=lambda _: None)


def _checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]]


class Snapshots(LocalExecutor):
    """The local executor, keeping a copy of the output folder as each phase starts: the folder a run killed
    right before that phase leaves."""

    def __init__(self, out: Path, into: Path) -> None:
        super().__init__()
        self.out, self.into, self.taken = out, into, []

    def run_tasks(self, fn, shared, items, desc, *, memory=None):
        if self.out.exists():
            self.taken.append(self.into / f"{len(self.taken):03d}")
            shutil.copytree(self.out, self.taken[-1])
        return super().run_tasks(fn, shared, items, desc, memory=memory)


class Killed:
    """The module's runs: `ref` finished; another killed as its shards phase started, with `snapshots` of its output
    folder as each phase started; `inputs` of both."""

    def __init__(self, base: Path) -> None:
        rows = [json.loads(line) for line in (helpers.ASSETS / "corpus_slice.jsonl").read_text().splitlines()]
        # ids the slice already has, on other texts: the run renames them (work/ids/renames/)
        twins = [{**r, "text": " ".join(reversed(r["text"].split()))} for r in rows[:8]]
        (base / "twins.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in twins))
        self.inputs = [{"path": str(helpers.ASSETS / "corpus_slice.jsonl"), "domain_field": "source"},
                       {"path": str(base / "twins.jsonl"), "domain_field": "source"}]
        self.ref = base / "ref"
        self.renamed = _run(_config(self.ref, self.inputs), LocalExecutor()).stats["duplicate_ids"]["renamed"]
        executor = Snapshots(base / "killed", base / "snapshots")
        shard_task = run_module.shard_task
        run_module.shard_task = _killed
        try:
            with pytest.raises(Interrupted):
                _run(_config(base / "killed", self.inputs), executor)
        finally:
            run_module.shard_task = shard_task
        self.snapshots = executor.taken
        self.moved_from = base / "killed"
        shutil.rmtree(self.moved_from)  # every resume is of a copy: a folder moved from where its run wrote it

    def first_with(self, relative: str) -> Path:
        """The first snapshot that holds `relative`: the folder of a run killed right after the task that wrote it."""
        return next(s for s in self.snapshots if (s / relative).exists())

    def resume_on_ray(self, out: Path) -> None:
        _run(_config(out, self.inputs), RayExecutor(progress=False, stall_timeout_s=STALL_S))


def _killed(*_, **__):
    raise Interrupted("killed")


@pytest.fixture(scope="module", autouse=True)
def every_exchange_combined():
    """The runs here are small enough for every exchange to read its senders' files directly; one file a receiver
    makes each of them combine (a choice the driver makes, `exchange.layout`), so that combined files are damaged
    too. The outputs do not depend on the choice."""
    from datapipe.core import exchange

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exchange, "RECEIVER_FILES", 1)
        yield


@pytest.fixture(scope="module")
def killed(tmp_path_factory, ray_local) -> Killed:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(helpers)  # in case a test stage goes to Ray's workers
    return Killed(tmp_path_factory.mktemp("integrity-ray"))


def _kind(relative: str) -> str:
    """A file's kind: its path with every number as N (work/read/uN-bN.arrow)."""
    return re.sub(r"\d+", "N", relative)


def _assert_paragraph(message: str, damaged: Path, out: Path) -> None:
    assert str(damaged) in message and (f"rm -r {out / 'work'}" in message or "run the same command" in message), message
    assert "Traceback" not in message and "RayTaskError" not in message and "\n" not in message, message


def _resume_damaged(killed: Killed, relative: str, how: str, to: Path) -> RunStopped | None:
    """Resume on Ray the first snapshot that holds `relative`, with that file damaged `how`: the paragraph it stopped
    with (checked), or None when it gave the reference's shards."""
    out = to / "out"
    shutil.copytree(killed.first_with(relative), out)
    damaged = out / relative
    helpers.damage(damaged, how)
    try:
        killed.resume_on_ray(out)
    except (RunStopped, ConfigError) as exc:  # the CLI prints either as one paragraph
        # a damaged record only means that its task runs again, which may find another file gone (a sender combined)
        _assert_paragraph(str(exc), out / "work" if _kind_of(relative).startswith("record") else damaged, out)
        return exc
    assert _checksums(out) == _checksums(killed.ref)
    return None


def test_a_damaged_read_block_found_in_a_ray_task_is_the_paragraph_and_its_recovery_the_same_shards(killed, tmp_path) -> None:
    stopped = _resume_damaged(killed, "work/read/u000000-b00001.arrow", "cut", tmp_path)  # a segment task reads it
    assert type(stopped) is RunStopped  # the run's paragraph, not the task's exception nor Ray's wrapper
    shutil.rmtree(tmp_path / "out" / "work")  # the recovery it names
    killed.resume_on_ray(tmp_path / "out")
    assert _checksums(tmp_path / "out") == _checksums(killed.ref)


def test_a_deleted_renames_file_is_never_read_as_no_renames(killed, tmp_path) -> None:
    assert killed.renamed > 0
    renames = min((killed.snapshots[-1] / "work" / "ids" / "renames").glob("u*/p*.arrow"))
    # the run renamed ids of that unit in that partition: the unit's folder alone does not say that the file is gone
    stopped = _resume_damaged(killed, str(renames.relative_to(killed.snapshots[-1])), "deleted", tmp_path)
    assert stopped is not None and "missing" in str(stopped)


def test_no_record_names_a_path_of_the_output_folder(killed) -> None:
    records = list((killed.snapshots[-1] / "work").rglob("*.json"))
    assert len(records) > 100
    naming = [str(r.relative_to(killed.snapshots[-1])) for r in records if str(killed.moved_from).encode() in r.read_bytes()]
    assert naming == []


def test_a_moved_killed_folder_resumes_from_its_own_files(killed, tmp_path) -> None:
    # killed right before the histograms are summed: the sums read the files that the histogram tasks' records name
    hist = max((killed.snapshots[-1] / "work" / "diversity" / "hist").glob("*.json"))
    snapshot = killed.first_with(str(hist.relative_to(killed.snapshots[-1])))
    assert not (snapshot / "work" / "records" / "select").exists()
    out = tmp_path / "moved"
    shutil.copytree(snapshot, out)
    killed.resume_on_ray(out)
    assert _checksums(out) == _checksums(killed.ref)


def _kind_of(relative: str) -> str:
    """A file's kind: its path with every number as N (work/read/uN-bN.arrow); every task record is of one kind."""
    if relative.startswith("work/") and relative.endswith(".json") and relative != "work/run.json":
        return "record"
    return re.sub(r"\d+", "N", relative)


def _files_by_kind(killed: Killed) -> dict[str, str]:
    """One file of each kind found in any snapshot: the first by name, under work/ and the files a resume reads
    outside it."""
    found: dict[str, str] = {}
    for snapshot in killed.snapshots:
        for path in snapshot.rglob("*"):
            relative = str(path.relative_to(snapshot))
            if path.is_file() and (relative.startswith("work/") or relative in OUTSIDE_WORK):
                kind = _kind_of(relative)
                found[kind] = min(found.get(kind, relative), relative)
    return found


OUTSIDE_WORK = ("run.json", "tokenizer.json", "selection/model.npz")  # what a resume reads outside work/
MODES = ("cut", "emptied", "bit", "deleted")
KINDS = {  # kind: one file of it
    'record': 'work/diversity/hist/u000000-b00000.json',
    'run.json': 'run.json',
    'selection/model.npz': 'selection/model.npz',
    'tokenizer.json': 'tokenizer.json',
    'work/diversity/hist/uN-bN.arrow': 'work/diversity/hist/u000000-b00000.arrow',
    'work/diversity/sample/combined-N.shuffle': 'work/diversity/sample/combined-00000.shuffle',
    'work/diversity/sample/uN-bN.shuffle': 'work/diversity/sample/u000000-b00000.shuffle',
    'work/diversity/uN-bN.arrow': 'work/diversity/u000000-b00000.arrow',
    'work/eval/candidates/combined-N.shuffle': 'work/eval/candidates/combined-00000.shuffle',
    'work/eval/candidates/uN-bN.shuffle': 'work/eval/candidates/u000000-b00000.shuffle',
    'work/eval/chosen/pN.arrow': 'work/eval/chosen/p000.arrow',
    'work/eval/decided/gN.arrow': 'work/eval/decided/g000.arrow',
    'work/eval/edges/gN.shuffle': 'work/eval/edges/g000.shuffle',
    'work/eval/hashes/uN-bN.arrow': 'work/eval/hashes/u000000-b00000.arrow',
    'work/eval/held.arrow': 'work/eval/held.arrow',
    'work/eval/near.arrow': 'work/eval/near.arrow',
    'work/eval/pairs-u/gN.shuffle': 'work/eval/pairs-u/g000.shuffle',
    'work/eval/pairs-v/gN.shuffle': 'work/eval/pairs-v/g000.shuffle',
    'work/eval/rows/uN-bN.arrow': 'work/eval/rows/u000000-b00000.arrow',
    'work/exact_dedup/keys/combined-N.shuffle': 'work/exact_dedup/keys/combined-00000.shuffle',
    'work/exact_dedup/keys/uN-bN.shuffle': 'work/exact_dedup/keys/u000000-b00000.shuffle',
    'work/exact_dedup/losers-by-unit/combined-N.shuffle': 'work/exact_dedup/losers-by-unit/combined-00000.shuffle',
    'work/exact_dedup/losers-by-unit/gN.shuffle': 'work/exact_dedup/losers-by-unit/g00000.shuffle',
    'work/exact_dedup/losers-by-unit/losers-tN.shuffle': 'work/exact_dedup/losers-by-unit/losers-t000.shuffle',
    'work/exact_dedup/losers-tN.arrow': 'work/exact_dedup/losers-t000.arrow',
    'work/ids/keys/combined-N.shuffle': 'work/ids/keys/combined-00000.shuffle',
    'work/ids/keys/uN-bN.shuffle': 'work/ids/keys/u000000-b00000.shuffle',
    'work/ids/rename-files.arrow': 'work/ids/rename-files.arrow',
    'work/ids/renames/uN/pN-of-N.arrow': 'work/ids/renames/u000001/p000-of-002.arrow',
    'work/lengths/uN-bN.arrow': 'work/lengths/u000000-b00000.arrow',
    'work/minhash/buckets/combined-N.shuffle': 'work/minhash/buckets/combined-00000.shuffle',
    'work/minhash/buckets/uN-bN.shuffle': 'work/minhash/buckets/u000000-b00000.shuffle',
    'work/minhash/cc/one-task/gN.shuffle': 'work/minhash/cc/one-task/g000.shuffle',
    'work/minhash/cc/rN/gN.shuffle': 'work/minhash/cc/r000/g000.shuffle',
    'work/minhash/clusters/gN.shuffle': 'work/minhash/clusters/g000.shuffle',
    'work/minhash/decided/gN.arrow': 'work/minhash/decided/g000.arrow',
    'work/minhash/frames/fN.shuffle': 'work/minhash/frames/f00000.shuffle',
    'work/minhash/losers-by-unit/gN.shuffle': 'work/minhash/losers-by-unit/g00000.shuffle',
    'work/minhash/losers-by-unit/losers-tN.shuffle': 'work/minhash/losers-by-unit/losers-t000.shuffle',
    'work/minhash/losers-tN.arrow': 'work/minhash/losers-t000.arrow',
    'work/minhash/members/gN.shuffle': 'work/minhash/members/g000.shuffle',
    'work/minhash/nodes-by-group/gN.arrow': 'work/minhash/nodes-by-group/g000.arrow',
    'work/minhash/nodes/combined-N.shuffle': 'work/minhash/nodes/combined-00000.shuffle',
    'work/minhash/nodes/uN-bN.shuffle': 'work/minhash/nodes/u000000-b00000.shuffle',
    'work/minhash/pairs-u/gN.shuffle': 'work/minhash/pairs-u/g000.shuffle',
    'work/minhash/pairs-v/gN.shuffle': 'work/minhash/pairs-v/g000.shuffle',
    'work/minhash/wanted/gN.shuffle': 'work/minhash/wanted/g000.shuffle',
    'work/model_select/excluded/uN-bN.arrow': 'work/model_select/excluded/u000000-b00000.arrow',
    'work/model_select/hist/uN-bN.arrow': 'work/model_select/hist/u000000-b00000.arrow',
    'work/model_select/model.npz': 'work/model_select/model.npz',
    'work/model_select/sample/combined-N.shuffle': 'work/model_select/sample/combined-00000.shuffle',
    'work/model_select/sample/uN-bN.shuffle': 'work/model_select/sample/u000000-b00000.shuffle',
    'work/model_select/uN-bN.arrow': 'work/model_select/u000000-b00000.arrow',
    'work/read/uN-bN.arrow': 'work/read/u000000-b00000.arrow',
    'work/run.json': 'work/run.json',
    'work/segN/uN-bN.arrow': 'work/seg0/u000000-b00000.arrow',
    'work/select/uN-bN.arrow': 'work/select/u000000-b00000.arrow',
    'work/tokenizer/sample/combined-N.shuffle': 'work/tokenizer/sample/combined-00000.shuffle',
    'work/tokenizer/sample/uN-bN.shuffle': 'work/tokenizer/sample/u000000-b00000.shuffle',
    'work/tokens/uN-bN.arrow': 'work/tokens/u000000-b00000.arrow',
}


def test_every_kind_of_work_file_is_in_the_damage_list(killed) -> None:
    # a new kind of file (or one gone) is added to KINDS (or taken out), so that every kind is damaged below
    assert _files_by_kind(killed) == KINDS


# the four modes rotated over the kinds (in their order above): every kind damaged once, every mode on many kinds;
# the selection model's two files left to the model test below, which damages each of them all four ways
# a task record (all of one format) damaged each way, in steps of four kinds: a block's, a combine's (its senders
# gone), a resolve's and a single task's
RECORDS = {"work/read/u000000.json": "bit", "work/exact_dedup/records/combine-keys-00000.json": "deleted",
           "work/minhash/losers-by-unit/g00000.json": "cut", "work/eval/records/attach-0.json": "emptied"}
MODEL_FILES = ("work/model_select/model.npz", "selection/model.npz")
CASES = [(KINDS[kind], MODES[i % len(MODES)]) for i, kind in enumerate(k for k in KINDS if k != "record")
         if kind not in MODEL_FILES]
CASES += list(RECORDS.items())


@pytest.mark.parametrize(("relative", "how"), CASES, ids=[f"{how}:{_kind_of(relative)}" for relative, how in CASES])
def test_a_damaged_file_resumed_on_ray_gives_the_same_shards_or_the_paragraph(killed, tmp_path, relative: str, how: str) -> None:
    _resume_damaged(killed, relative, how, tmp_path)


def test_a_finished_folder_without_a_sound_run_json_says_how_to_recover(killed, tmp_path) -> None:
    # A finished run kept no copy of run.json (work/ is gone): cut or deleted, nothing says which config made the
    # output, so the run stops with the paragraph (was JSONDecodeError's traceback, or "not empty ... use an empty
    # folder": the work lost), and the recovery it names gives the same shards.
    out = tmp_path / "out"
    shutil.copytree(killed.ref, out)
    for how in ("cut", "deleted"):
        helpers.damage(out / "run.json", how)
        with pytest.raises(ConfigError) as info:
            killed.resume_on_ray(out)
        message = str(info.value)
        assert f"{out}/run.json is damaged" in message and f"rm -r {out} and run the same command again" in message
        assert "Traceback" not in message and "\n" not in message
    shutil.rmtree(out)
    killed.resume_on_ray(out)
    assert _checksums(out) == _checksums(killed.ref)


def test_a_finished_folder_with_a_damaged_manifest_or_stats_says_how_to_recover(killed, tmp_path) -> None:
    out = tmp_path / "out"
    shutil.copytree(killed.ref, out)
    for name, how in (("stats.json", "deleted"), ("manifest.json", "cut")):
        helpers.damage(out / name, how)
        with pytest.raises(ConfigError) as info:  # was json's traceback, or "No such file" from the rerun's report
            _run(_config(out, killed.inputs), LocalExecutor())
        message = str(info.value)
        assert f"finished run whose {name} is damaged or gone" in message and "Traceback" not in message
        assert f"delete {out}/manifest.json and run the same command again" in message
    (out / "manifest.json").unlink()  # the recovery it names
    _run(_config(out, killed.inputs), LocalExecutor())
    assert _checksums(out) == _checksums(killed.ref)


def test_a_damaged_model_file_stops_with_the_paragraph_and_its_copy_for_later_runs_is_written_again(killed, tmp_path) -> None:
    """Resumed after the fit's record: the model's work copy damaged any way is the paragraph naming it (its recovery:
    the same shards); the copy in OUT/selection/ damaged any way is written again from the work copy, byte for byte."""
    saved, published = MODEL_FILES
    fitted = (killed.first_with(saved) / published).read_bytes()
    for how in MODES:
        stopped = _resume_damaged(killed, saved, how, tmp_path / f"work-{how}")
        assert stopped is not None and saved in str(stopped)
        assert _resume_damaged(killed, published, how, tmp_path / f"out-{how}") is None
        assert (tmp_path / f"out-{how}" / "out" / published).read_bytes() == fitted
    shutil.rmtree(tmp_path / "work-cut" / "out" / "work")  # the recovery the paragraph names
    killed.resume_on_ray(tmp_path / "work-cut" / "out")
    assert _checksums(tmp_path / "work-cut" / "out") == _checksums(killed.ref)


# ------------------------------------------------------------------ outputs outside work/, damaged after their task

@pytest.fixture(scope="module")
def killed_after_shards(tmp_path_factory, killed) -> Path:
    """The module's run killed after every task, right before its manifest: every output outside work/ is written
    and every task's record names the outputs it published."""
    out = tmp_path_factory.mktemp("after-shards") / "killed"
    build_manifest = run_module.build_manifest
    run_module.build_manifest = _killed
    try:
        with pytest.raises(Interrupted):
            _run(_config(out, killed.inputs), LocalExecutor())
    finally:
        run_module.build_manifest = build_manifest
    return out


def _outputs_by_kind(folder: Path) -> dict[str, str]:
    """One file of each kind of output a task publishes outside work/ (the first by name)."""
    found: dict[str, str] = {}
    for path in folder.rglob("*"):
        relative = str(path.relative_to(folder))
        if path.is_file() and not relative.startswith("work/") and relative not in (*OUTSIDE_WORK, "run.log"):
            found[_kind_of(relative)] = min(found.get(_kind_of(relative), relative), relative)
    return found


OUTPUT_KINDS = ["dropped/model-uN-bN.parquet", "dropped/segN-uN-bN.parquet", "dropped/select-uN-bN.parquet",
                "eval/shards/shard-N.arrow", "near_duplicates/clusters/part-N.parquet", "selection/scores/uN-bN.parquet",
                "shards/shard-N.arrow"]


def test_every_kind_of_published_output_is_in_the_damage_list(killed_after_shards) -> None:
    assert sorted(_outputs_by_kind(killed_after_shards)) == OUTPUT_KINDS


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_an_output_damaged_after_its_task_is_written_again_by_it_on_resume(killed, killed_after_shards, tmp_path,
                                                                          kind: str) -> None:
    """Cut, emptied, one bit flipped or deleted (the four in turn over the kinds) after its task finished: the resume
    on Ray writes it again, as the reference run wrote it, and the manifest lists what is there."""
    relative = _outputs_by_kind(killed_after_shards)[kind]
    how = MODES[OUTPUT_KINDS.index(kind) % len(MODES)]
    out = tmp_path / "out"
    shutil.copytree(killed_after_shards, out)
    helpers.damage(out / relative, how)
    killed.resume_on_ray(out)
    assert _checksums(out) == _checksums(killed.ref)
    assert (out / relative).read_bytes() == (killed.ref / relative).read_bytes()
