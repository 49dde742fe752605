"""A run's identity (OUT/run.json): a killed run resumed with other execution-only settings ends with the
same shards; one resumed with another work layout, edited inputs or an edited tokenizer is refused with
a message naming the key or file; the Ray address comes from the config, else RAY_ADDRESS."""

from __future__ import annotations

import importlib.util
import logging
import re
import uuid
from pathlib import Path

import fsspec
import orjson
import pytest

from helpers import ASSETS, small_config
from datapipe.core.config import from_dict, to_dict
from datapipe.core.shards import read_manifest
from datapipe.curation import config as curate_config
from datapipe.curation.config import CurateConfig
from datapipe.curation.executors import LocalExecutor, ray_address
from datapipe.curation.executors._embedded import _RAY_AUTH_LOGGER, _DropTokenAuthNotice
from datapipe.curation.identity import RunConflict
from datapipe import curate


class _Interrupt(Exception):
    pass


class KilledAfter(LocalExecutor):
    """A run killed after `n` tasks of any phase (read, segments, resolves, tokenize, shards): the
    next task raises before it starts. `n=None` never kills; `descs` lists each task's phase."""

    def __init__(self, n: int | None = None) -> None:
        super().__init__()
        self.left = n
        self.descs: list[str] = []

    def run_tasks(self, fn, shared, items, desc, **kwargs):
        def task(shared, *item):
            if self.left is not None:
                if self.left <= 0:
                    raise _Interrupt(f"killed before a {desc} task")
                self.left -= 1
            self.descs.append(desc)
            return fn(shared, *item)

        return super().run_tasks(task, shared, items, desc)


def run(cfg, executor=None):
    return curate(cfg, executor=executor or LocalExecutor(), progress=False, log=lambda _: None)


def checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]]


@pytest.fixture
def dup_input(tmp_path) -> dict:
    """The corpus slice plus exact copies (new ids) and near copies (one word changed) of some of its
    documents, so both dedup stages have losers to decide."""
    records = [orjson.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
    extra = []
    for i, r in enumerate(records[:40]):
        if i % 2:
            extra.append({**r, "id": f"exact-{i}"})
        else:
            words = r["text"].split(" ")
            words[len(words) // 2] = "changed"
            extra.append({**r, "id": f"near-{i}", "text": " ".join(words)})
    path = tmp_path / "dups.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records + extra) + b"\n")
    return {"path": str(path), "domain_field": "source"}


def dup_config(out: Path, inp: dict, **sections):
    sections.setdefault("dedup", {"exact": {"partitions": 8}, "minhash": {"enabled": True, "partitions": 8}})
    return small_config(out, [inp], read={"block_bytes": 4096, "batch_size": 16}, **sections)


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[last] = value


# Every execution-only key but the work-layout ones and the output folder itself, with a value other
# than the one the killed run started with.
RESUME_CHANGES = {
    "ray.address": "auto",  # unused with an executor given; part of the config all the same
    "ray.num_cpus": 3,
    "ray.max_retries": 7,
    "output.keep_work": True,
    "dedup.minhash.max_rounds": 40,
    "dedup.minhash.one_task_edges": 0,  # the started run found its components in one task; now in rounds
    "read.batch_size": 5,
    "tokenizer.batch_size": 7,
    "tokenizer.encoder": "tokenizers",
    "tokenizer.verify_bytes": 0,
}


def test_every_execution_only_key_is_covered_here():
    """A key added to the execution-only list must be added to RESUME_CHANGES or WORK_LAYOUT_KEYS."""
    covered = {tuple(k.split(".")) for k in RESUME_CHANGES} | set(curate_config.WORK_LAYOUT_KEYS) | {("output", "dir")}
    for key in curate_config._EXECUTION_ONLY:
        assert key in covered or any(c[: len(key)] == key for c in covered), key


def first_segment(descs: list[str]) -> str:
    """The phase name of the first segment of map stages: the first phase after read and unique_ids."""
    return next(d for d in descs if d not in ("read", "unique_ids"))


def test_resume_with_every_other_execution_only_key_changed_gives_identical_shards(tmp_path, dup_input):
    ref = tmp_path / "ref"
    recorder = KilledAfter()
    run(dup_config(ref, dup_input), recorder)
    descs = recorder.descs
    assert "minhash members" in descs and "minhash components" in descs  # near duplicates were resolved
    # Kill points: among the id renames, mid-way through the first segment, inside near dedup's resolve
    # (between its components and its members), mid-tokenize, mid-shards.
    seg0 = first_segment(descs)
    kills = [descs.index("unique_ids") + 1, descs.index(seg0) + 5, descs.index("minhash members") + 1,
             descs.index("tokenize") + 3, descs.index("shards") + 1]
    for k, kill in enumerate(kills):
        out = tmp_path / f"out{k}"
        with pytest.raises(_Interrupt):
            run(dup_config(out, dup_input), KilledAfter(kill))
        assert not (out / "manifest.json").exists()
        changed = dup_config(out, dup_input)
        data = to_dict(changed)
        for key, value in RESUME_CHANGES.items():
            _set(data, key, value)
        changed = from_dict(CurateConfig, data)
        resumed = run(changed, KilledAfter())
        assert checksums(out) == checksums(ref), f"killed after {kill} tasks ({descs[kill]})"
        assert resumed.manifest["config_hash"] == read_manifest(ref)["config_hash"]
        assert resumed.stats["global_stages"]["minhash"]["removed"] > 0


@pytest.mark.parametrize(("key", "started", "resumed"), [
    ("dedup.exact.partitions", 8, 3),
    ("dedup.minhash.partitions", 8, 3),
    ("read.block_bytes", 4096, 1024),
])
def test_resume_with_another_work_layout_is_refused_naming_the_key(tmp_path, dup_input, key, started, resumed):
    ref = tmp_path / "ref"
    recorder = KilledAfter()
    run(dup_config(ref, dup_input), recorder)

    def cfg(value):
        data = to_dict(dup_config(tmp_path / "out", dup_input))
        _set(data, key, value)
        return from_dict(CurateConfig, data)

    # Killed mid-way through the first segment: the read blocks and some blocks' keys are written under
    # the value it started with. (Before the refusal, such a run resumed with exact partitions 3, near
    # dedup off, kept 52 documents where the reference keeps 27: keys left in partitions 3..7 were never
    # resolved; resumed with another block_bytes, stale blocks' ids renamed 29 documents `x#2`.)
    with pytest.raises(_Interrupt):
        run(cfg(started), KilledAfter(recorder.descs.index(first_segment(recorder.descs))
                                   + recorder.descs.count(first_segment(recorder.descs)) // 2))
    with pytest.raises(RunConflict, match=rf"started with {key}={started}, not {resumed}.*--set {key}={started}"):
        run(cfg(resumed))
    run(cfg(started))
    assert checksums(tmp_path / "out") == checksums(ref)
    run(cfg(resumed))  # a finished run is not refused: its work is done (and gone), it is complete


def _killed_mid_first_segment(tmp_path, dup_input, cfg) -> None:
    """`cfg` run killed mid-way through its first segment, as in the test above."""
    recorder = KilledAfter()
    run(cfg(tmp_path / "ref"), recorder)
    seg0 = first_segment(recorder.descs)
    with pytest.raises(_Interrupt):
        run(cfg(tmp_path / "out"), KilledAfter(recorder.descs.index(seg0) + recorder.descs.count(seg0) // 2))


def test_resume_with_another_task_memory_is_refused_naming_it_not_the_auto_partitions(tmp_path, dup_input):
    """`dedup.exact.partitions: auto` is sized from ray.task_memory_gib: a resume with another task memory gets
    other partitions, and the refusal names ray.task_memory_gib (what the user changed), not the partitions."""
    # ~100 KB of text: 2 KiB of task memory gives ~50 exact-dedup partitions, 16 KiB their floor of 16.
    started, resumed = 2**-19, 2**-16

    def cfg(out, memory=started):
        return dup_config(out, dup_input, dedup={"exact": {"partitions": "auto"}, "minhash": {"enabled": True, "partitions": 8}},
                          ray={"task_memory_gib": memory})

    _killed_mid_first_segment(tmp_path, dup_input, cfg)
    out = tmp_path / "out"
    layout = orjson.loads((out / "run.json").read_bytes())["work_layout"]
    assert layout["auto"] == {"dedup.exact.partitions": {"ray.task_memory_gib": started}}
    partitions = layout["dedup.exact.partitions"]
    assert partitions > 16
    expected = (rf"started with ray\.task_memory_gib={re.escape(repr(started))} \(which set dedup\.exact\.partitions="
                rf"{partitions} by `auto`\), not {re.escape(repr(resumed))} \(which sets it to 16\).*"
                rf"`--set ray\.task_memory_gib={re.escape(str(started))}`")
    with pytest.raises(RunConflict, match=expected):
        run(cfg(out, resumed))
    # A record written before the `auto` values were kept: the refusal names the layout key, as it did.
    record = orjson.loads((out / "run.json").read_bytes())
    del record["work_layout"]["auto"]
    (out / "run.json").write_bytes(orjson.dumps(record))
    (out / "work" / "run.json").unlink()  # that version kept no checked copy in work/ (it would restore run.json)
    with pytest.raises(RunConflict, match=rf"started with dedup\.exact\.partitions={partitions}, not 16.*"
                                          rf"--set dedup\.exact\.partitions={partitions}"):
        run(cfg(out, resumed))
    run(cfg(out))
    assert checksums(out) == checksums(tmp_path / "ref")


def test_an_input_edited_between_kill_and_resume_is_refused(tmp_path, slice_input):
    src = Path(slice_input["path"]).read_bytes()
    path = tmp_path / "in.jsonl"
    path.write_bytes(src)
    inp = {**slice_input, "path": str(path)}
    out = tmp_path / "out"
    with pytest.raises(_Interrupt):
        run(small_config(out, [inp]), KilledAfter(4))
    lines = src.splitlines()
    path.write_bytes(b"\n".join(lines[:-1]) + b"\n")  # one document fewer: a smaller file
    with pytest.raises(RunConflict, match=rf"input file '{path}' changed since the run .* \(size .* -> .* bytes\).*Restore"):
        run(small_config(out, [inp]))
    # The same size, other content (one letter changed): the modification time tells.
    path.write_bytes(src.replace(b"the", b"thE", 1))
    assert path.stat().st_size == len(src)
    with pytest.raises(RunConflict, match=rf"input file '{path}' changed .*same size, modified since.*another --output"):
        run(small_config(out, [inp]))


def test_a_finished_run_whose_input_was_edited_is_not_reported_complete(tmp_path, slice_input):
    path = tmp_path / "in.jsonl"
    path.write_bytes(Path(slice_input["path"]).read_bytes())
    inp = {**slice_input, "path": str(path)}
    out = tmp_path / "out"
    run(small_config(out, [inp]))
    with path.open("ab") as f:
        f.write(orjson.dumps({"id": "new", "text": "a document added after the run", "source": "man"}) + b"\n")
    with pytest.raises(RunConflict, match=rf"input file '{path}' changed"):
        run(small_config(out, [inp]))


def test_an_input_file_added_to_a_glob_is_named(tmp_path, slice_input):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(Path(slice_input["path"]).read_bytes())
    inp = {**slice_input, "path": str(folder / "*.jsonl")}
    out = tmp_path / "out"
    with pytest.raises(_Interrupt):
        run(small_config(out, [inp]), KilledAfter(2))
    (folder / "b.jsonl").write_text('{"id": "b", "text": "hello"}\n')
    with pytest.raises(RunConflict, match=r"inputs: the input files differ \(new: \[.*b\.jsonl'\]\)"):
        run(small_config(out, [inp]))


def test_a_remote_input_rewritten_between_kill_and_resume_is_refused(tmp_path, slice_input):
    url = f"memory://identity-{uuid.uuid4().hex}/in.jsonl"
    src = Path(slice_input["path"]).read_bytes()
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe(url, src)
        inp = {**slice_input, "path": url}
        out = tmp_path / "out"
        with pytest.raises(_Interrupt):
            run(small_config(out, [inp]), KilledAfter(3))
        fs.pipe(url, src.replace(b"the", b"thE", 1))  # same size: the object's version tells
        with pytest.raises(RunConflict, match=rf"input file '{url}' changed"):
            run(small_config(out, [inp]))
    finally:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_a_tokenizer_edited_between_kill_and_resume_is_refused(tmp_path, slice_input):
    from stages.tokenize import TokenizerConfig, train_tokenizer

    tok = tmp_path / "tok.json"
    train_tokenizer(["some text for a tiny vocabulary"] * 20, TokenizerConfig(eos_token="<eos>")).save(str(tok))
    cfg = small_config(tmp_path / "out", [slice_input], tokenizer={"path": str(tok), "eos_token": "<eos>"})
    recorder = KilledAfter()
    run(small_config(tmp_path / "probe", [slice_input], tokenizer={"path": str(tok), "eos_token": "<eos>"}), recorder)
    with pytest.raises(_Interrupt):  # killed with some blocks tokenized by the first tokenizer
        run(cfg, KilledAfter(recorder.descs.index("tokenize") + 2))
    train_tokenizer(["other words entirely, another vocabulary"] * 20, TokenizerConfig(eos_token="<eos>")).save(str(tok))
    with pytest.raises(RunConflict, match=rf"tokenizer.path '{tok}' changed since the run .*Restore"):
        run(cfg)


def test_ray_address_from_the_config_else_ray_address_else_embedded():
    assert ray_address("ray://head:10001", {"RAY_ADDRESS": "auto"}) == "ray://head:10001"
    assert ray_address(None, {"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert ray_address(None, {"RAY_ADDRESS": ""}) is None  # set but empty: as ray.init reads it, unset
    assert ray_address(None, {}) is None


def test_rays_token_auth_notice_is_dropped_and_its_logger_exists():
    notice = _DropTokenAuthNotice()

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord(_RAY_AUTH_LOGGER, logging.WARNING, __file__, 1, msg, None, None)

    assert not notice.filter(record("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled"))
    assert notice.filter(record("Token authentication is enabled but no token was found"))  # a real problem stays
    assert importlib.util.find_spec(_RAY_AUTH_LOGGER) is not None  # the module Ray logs it from
