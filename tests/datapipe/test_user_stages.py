"""Your own stages named in the recipe (`stages:`): built from an import path and args, run after the shipped
filters, counted under their own name, part of the run's identity, refused with the key named when wrong, and
shipped to the workers of a real Ray cluster."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ASSETS, STALL_S
from datapipe.cli import main
from datapipe.core.config import ConfigError
from datapipe.core.shards import open_shard, read_manifest
from datapipe.curation.config import StageConfig, config_hash, load_config, result_affecting
from datapipe.curation.executors import LocalExecutor, RayExecutor
from datapipe.curation.user_stages import UserStageFailed, worker_modules

ROOT = Path(__file__).resolve().parents[2]

FILTER = '''
class ShortDocs:
    name = "short_docs"

    def __init__(self, min_words=5):
        self.min_words = min_words

    def check(self, text):
        return "too_few_words" if len(text.split()) < self.min_words else None


class NotAStage:
    def __init__(self, **kwargs):
        pass


class Named:
    name = "filters"

    def check(self, text):
        return None
'''

STAGE = '''
from stages.base import split_by_reasons


class DropLicenses:
    name = "no_licenses"

    def __call__(self, batch):
        reasons = ["license" if d == "license" else None for d in batch.column("domain").to_pylist()]
        return split_by_reasons(batch, reasons, self.name)
'''

BROKEN = '''
from stages.base import StageResult, split_by_reasons


class KeepsHalf:  # loses documents: neither kept nor dropped
    name = "keeps_half"

    def __call__(self, batch):
        result = split_by_reasons(batch, [None] * batch.num_rows, self.name)
        return StageResult(result.kept.slice(0, batch.num_rows // 2), result.dropped)
'''

FAULTY = '''
import threading


class RaisesOn:
    name = "raises_on"

    def __init__(self, marker):
        self.marker = marker

    def check(self, text):
        if self.marker in text:
            raise ValueError("cannot read this one")
        return None


class Answers:
    name = "answers"

    def __init__(self, answer):
        self.answer = answer

    def check(self, text):
        return self.answer


class HoldsALock:
    name = "holds_a_lock"

    def __init__(self):
        self.lock = threading.Lock()

    def check(self, text):
        return None


class RaisingStage:
    name = "raising_stage"

    def __call__(self, batch):
        raise KeyError("no such column")
'''


def _module(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    """A module of the user's, `name`.py in its own folder on the import path (as the working folder is)."""
    folder = tmp_path / "mods"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _recipe(tmp_path: Path, stages: str, out: str = "out") -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"inputs: [{{path: '{ASSETS / 'corpus_slice.jsonl'}', domain_field: source}}]\n"
        "read: {block_bytes: 8192}\nfilters: {code: {code: {}}}\n"
        f"stages: {stages}\n"
        f"tokenizer: {{train: {{vocab_size: 400}}}}\noutput: {{dir: '{tmp_path / out}', shard_bytes: 8192}}\n"
    )
    return cfg


def _run(cfg, executor=None):
    from datapipe import curate  # the public entry point

    return curate(cfg, executor=executor or LocalExecutor(), progress=False, log=lambda _: None)


def test_a_filter_named_in_the_recipe_drops_under_its_own_name(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "user_filters_a", FILTER)
    cfg = load_config(_recipe(tmp_path, f"[{{path: '{mod}:ShortDocs', args: {{min_words: 200}}, domains: [code, man]}}]"))
    stats = _run(cfg).stats
    funnel = {row["stage"]: row["domains"] for row in stats["funnel"]}
    assert [row["stage"] for row in stats["funnel"]][-2:] == ["filters", "short_docs"]  # after the shipped filters
    assert funnel["short_docs"]["license"]["docs_in"] == funnel["short_docs"]["license"]["docs_out"]  # not its domain
    assert stats["dropped"]["short_docs"]["code"] == {"short_docs:too_few_words": 7}
    assert stats["dropped"]["short_docs"]["man"] == {"short_docs:too_few_words": 5}
    assert "license" not in stats["dropped"]["short_docs"]
    assert main(["stats", str(cfg.output.dir)]) == 0
    assert "short_docs:too_few_words" in capsys.readouterr().out


def test_a_map_stage_named_in_the_recipe_runs_on_every_document(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_stage_b", STAGE)
    stats = _run(load_config(_recipe(tmp_path, f"[{{path: '{mod}:DropLicenses', version: 2}}]"))).stats
    assert stats["dropped"]["no_licenses"] == {"license": {"license": 8}}


def test_a_map_stage_that_loses_documents_stops_the_run_naming_its_entry(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_stage_broken", BROKEN)
    with pytest.raises(ConfigError, match=r"stages\[0\]: stage 'keeps_half' kept \d+ and dropped 0 of \d+ documents"):
        _run(load_config(_recipe(tmp_path, f"[{{path: '{mod}:KeepsHalf'}}]")))


def _executor(kind: str, request, module: str):
    """The local loop, or a Ray executor on the session's Ray, whose workers get the user's module by value (the
    module's folder is on the driver's path only)."""
    if kind == "local":
        return LocalExecutor()
    request.getfixturevalue("ray_local")
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    return RayExecutor(progress=False, stall_timeout_s=STALL_S)


def _only_line_with(marker: str) -> tuple[int, str]:
    """The line number and id of the one record of the slice whose text holds `marker`."""
    lines = [(n, json.loads(line)) for n, line in enumerate((ASSETS / "corpus_slice.jsonl").read_text().splitlines(), 1)]
    found = [(n, record["id"]) for n, record in lines if marker in record["text"]]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("kind", ["local", pytest.param("ray", marks=pytest.mark.ray_local)])
def test_a_check_that_raises_names_the_filter_the_document_and_its_line(tmp_path, monkeypatch, request, kind):
    mod = _module(tmp_path, monkeypatch, f"user_faulty_raise_{kind}", FAULTY)
    cfg = load_config(_recipe(tmp_path, f"[{{path: '{mod}:RaisesOn', args: {{marker: 'GROUPDEL(8)'}}}}]"))
    line, doc_id = _only_line_with("GROUPDEL(8)")
    with pytest.raises(UserStageFailed) as failed:  # itself, not Ray's wrapper of the worker's stack
        _run(cfg, _executor(kind, request, mod))
    message = str(failed.value)
    assert message.startswith(f"stages[0]: filter 'raises_on' ({mod}:RaisesOn), on document {doc_id!r} "
                              f"(line {line} of {ASSETS / 'corpus_slice.jsonl'}): its check raised ValueError: "
                              f"cannot read this one ({tmp_path / 'mods' / f'{mod}.py'}, line 13, in check). Fix check")
    assert "Traceback" not in message and "RayTaskError" not in message


@pytest.mark.parametrize("answer, kind", [pytest.param("false", "ray", marks=pytest.mark.ray_local), ("true", "local"),
                                          ("42", "local"), ("0.5", "local")])
def test_a_check_answering_other_than_none_or_a_string_stops_the_run(tmp_path, monkeypatch, request, answer, kind):
    mod = _module(tmp_path, monkeypatch, f"user_faulty_answer_{kind}_{answer.replace('.', '_')}", FAULTY)
    cfg = load_config(_recipe(tmp_path, f"[{{path: '{mod}:Answers', args: {{answer: {answer}}}}}]"))
    with pytest.raises(UserStageFailed, match=rf"stages\[0\]: filter 'answers' \({mod}:Answers\), on document '[^']+' "
                       rf"\(line \d+ of .*\): check returned {answer.capitalize()} \(a \w+\); a filter's check returns "
                       r"None or \"\" to keep a document, or a non-empty string"):
        _run(cfg, _executor(kind, request, mod))


def test_a_check_answering_an_empty_string_keeps_and_a_reason_drops(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_faulty_strings", FAULTY)
    kept = _run(load_config(_recipe(tmp_path, f"[{{path: '{mod}:Answers', args: {{answer: ''}}}}]", out="kept"))).stats
    assert "answers" not in kept["dropped"]
    records = [json.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_text().splitlines()]
    man_pages = len({r["text"] for r in records if r["source"] == "man"})  # exact dedup keeps one of each text
    entry = f"[{{path: '{mod}:Answers', args: {{answer: 'meh'}}, domains: [man]}}]"
    dropped = _run(load_config(_recipe(tmp_path, entry, out="dropped"))).stats["dropped"]["answers"]
    assert dropped == {"man": {"answers:meh": man_pages}}


def test_a_map_stage_that_raises_names_the_stage_and_the_batch(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_faulty_stage", FAULTY)
    cfg = load_config(_recipe(tmp_path, f"[{{path: '{mod}:RaisingStage'}}]"))
    with pytest.raises(UserStageFailed, match=rf"stages\[0\]: stage 'raising_stage' \({mod}:RaisingStage\), on a batch of "
                       rf"\d+ documents \('[^']+' to '[^']+', lines \d+ to \d+ of .*corpus_slice.jsonl\): it raised KeyError: "
                       r"'no such column' \(.*, line \d+, in __call__\)\. Fix the stage"):
        _run(cfg)


def _run_extra(cfg, extra, executor=None):
    from datapipe import curate

    return curate(cfg, executor=executor or LocalExecutor(), extra_stages=extra, progress=False, log=lambda _: None)


@pytest.mark.ray_local
def test_a_raising_extra_stage_on_ray_names_itself_the_batch_and_the_user_s_line(tmp_path, monkeypatch, request):
    """`curate(cfg, extra_stages=[...])` wraps its stages as the recipe's are: on the Ray executor the error is the
    stage's, naming it, the documents and the line of the user's file, not Ray's wrapper of a worker's stack."""
    mod = _module(tmp_path, monkeypatch, "user_extra_raise", FAULTY)
    stage = importlib.import_module(mod).RaisingStage()
    cfg = load_config(_recipe(tmp_path, "[]"))
    with pytest.raises(UserStageFailed) as failed:
        _run_extra(cfg, [stage], _executor("ray", request, mod))
    message = str(failed.value)
    assert re.match(rf"extra_stages\[0\]: stage 'raising_stage' \({mod}\.RaisingStage\), on a batch of \d+ documents "
                    rf"\('[^']+' to '[^']+', lines \d+ to \d+ of .*corpus_slice.jsonl\): it raised KeyError: 'no such "
                    rf"column' \({re.escape(str(tmp_path / 'mods' / f'{mod}.py'))}, line \d+, in __call__\)", message), message
    assert "Traceback" not in message and "RayTaskError" not in message


def test_an_extra_filter_object_drops_under_its_name_and_anything_else_is_refused_before_any_work(tmp_path, monkeypatch):
    mod = importlib.import_module(_module(tmp_path, monkeypatch, "user_extra_filter", FILTER))
    cfg = load_config(_recipe(tmp_path, "[]"))
    stats = _run_extra(cfg, [mod.ShortDocs(min_words=50)]).stats
    assert sum(stats["dropped"]["short_docs"].get(d, {}).get("short_docs:too_few_words", 0) for d in stats["dropped"]["short_docs"]) > 0
    for extra, message in (([mod.NotAStage()], r"extra_stages\[0\]: a user_extra_filter.NotAStage has no non-empty string `name`"),
                           ([mod.Named()], r"extra_stages\[0\]: the stage name 'filters' is taken"),
                           ([mod.ShortDocs(), mod.ShortDocs()], r"extra_stages\[1\]: the stage name 'short_docs' is taken")):
        out = tmp_path / f"refused-{len(extra)}-{type(extra[0]).__name__}"
        with pytest.raises(ConfigError, match=message):
            _run_extra(load_config(_recipe(tmp_path, "[]", out=out.name)), extra)
        assert not out.exists()  # refused before the output folder was claimed


@pytest.mark.ray_local
def test_a_stage_holding_a_lock_names_the_stage_and_the_attribute_on_ray(tmp_path, monkeypatch, request):
    mod = _module(tmp_path, monkeypatch, "user_faulty_lock", FAULTY)
    cfg = load_config(_recipe(tmp_path, f"[{{path: '{mod}:HoldsALock'}}]"))
    with pytest.raises(ConfigError) as refused:
        _run(cfg, _executor("ray", request, mod))
    message = str(refused.value)
    assert (f"its tasks cannot be sent to Ray's workers: stage 'holds_a_lock' ({mod}.HoldsALock) holds .lock, a "
            "_thread.lock, which cannot be pickled (TypeError: cannot pickle '_thread.lock' object)") in message
    assert len(message) < 800  # not the plan's repr
    assert _run(cfg).stats["dropped"]  # the local loop pickles nothing: the same stage runs there


def test_the_example_recipe_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # its input and module are named from the repository's root
    cfg = load_config(ROOT / "examples" / "user-stage.yaml", output=str(tmp_path / "out"))
    assert _run(cfg).stats["dropped"]["capitals"] == {"license": {"capitals:too_many_capitals": 3}}


class StopAfter(LocalExecutor):
    """Runs `n` tasks, then stops the run as a kill would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def run_tasks(self, fn, shared, items, desc, *, memory=None):
        out = []
        for item in items:
            if self.left == 0:
                raise KeyboardInterrupt
            self.left -= 1
            out.append(fn(shared, *item))
        return out


@pytest.mark.parametrize("finished", [True, False])
def test_changed_args_refuse_the_run_in_the_folder_naming_the_key(tmp_path, monkeypatch, finished):
    mod = _module(tmp_path, monkeypatch, "user_filters_c", FILTER)
    recipe = _recipe(tmp_path, f"[{{path: '{mod}:ShortDocs', args: {{min_words: 200}}, version: '1'}}]")
    cfg = load_config(recipe)
    if finished:
        _run(cfg)
    else:
        with pytest.raises(KeyboardInterrupt):
            _run(cfg, StopAfter(6))  # the read and a few blocks' filters: an unfinished run
    for change, named in (("stages.0.args.min_words=100", "stages.0.args.min_words: 200 -> 100"),
                          ("stages.0.version=2", "stages.0.version: '1' -> 2")):
        with pytest.raises(ConfigError, match="holds a run made with a different config") as refused:
            _run(load_config(recipe, [change]))
        assert named in str(refused.value)
    assert _run(load_config(recipe)).stats["dropped"]["short_docs"]  # the same config: reused, or resumed


def test_stages_are_part_of_the_identity_and_none_leaves_it_as_it_was(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_filters_d", FILTER)
    plain = load_config(_recipe(tmp_path, "[]"))
    assert "stages" not in result_affecting(plain)  # a run of before the key keeps its config hash
    one = load_config(_recipe(tmp_path, f"[{{path: '{mod}:ShortDocs', args: {{min_words: 3}}}}]"))
    other = load_config(_recipe(tmp_path, f"[{{path: '{mod}:ShortDocs', args: {{min_words: 4}}}}]"))
    assert len({config_hash(plain), config_hash(one), config_hash(other)}) == 3


@pytest.mark.parametrize("entry, message", [
    ("{path: 'no_colon'}", r"stages\[0\]\.path: 'no_colon' is not an import path 'module:attr'"),
    ("{path: 'no_such_module_here:X'}", r"stages\[0\]\.path: cannot import module 'no_such_module_here'"),
    ("{path: 'MOD:Missing'}", r"stages\[0\]\.path: module 'MOD' has no attribute 'Missing'"),
    ("{path: 'MOD:ShortDocs', args: {min_word: 3}}", r"stages\[0\]\.args: .*unexpected keyword argument 'min_word'"),
    ("{path: 'MOD:NotAStage'}", r"stages\[0\]\.path: .*neither a map stage nor a document filter"),
    ("{path: 'MOD:Named'}", r"stages\[0\]\.path: the stage name 'filters' is a shipped stage's"),
    ("{path: 'MOD:ShortDocs'}, {path: 'MOD:ShortDocs'}", r"stages\[1\]\.path: the stage name 'short_docs' is stages\[0\]'s"),
    ("{path: 'STAGE:DropLicenses', domains: [code]}", r"stages\[0\]\.domains: 'no_licenses' is a map stage"),
    ("{path: ''}", r"stages\[0\]\.path must name a class"),
])
def test_a_wrong_entry_is_a_config_error_naming_its_key(tmp_path, monkeypatch, entry, message):
    mod = _module(tmp_path, monkeypatch, "user_filters_e", FILTER)
    stage = _module(tmp_path, monkeypatch, "user_stage_e", STAGE)
    recipe = _recipe(tmp_path, "[" + entry.replace("MOD", mod).replace("STAGE", stage) + "]")
    with pytest.raises(ConfigError, match=message.replace("MOD", mod)):
        load_config(recipe)


def test_the_cli_says_a_bad_path_in_one_line(tmp_path, capsys):
    assert main(["curate", str(_recipe(tmp_path, "[{path: 'nowhere_at_all:X'}]")), "--executor", "local"]) == 2
    err = capsys.readouterr().err
    assert "stages[0].path: cannot import module 'nowhere_at_all'" in err and "Traceback" not in err


def test_from_datapipe_import_curate_is_lazy():
    code = ("import sys, datapipe; assert 'datapipe.curation' not in sys.modules; "
            "from datapipe import curate, CurateConfig, load_config; import datapipe.curation.run as run; "
            "from datapipe import curate as again; assert callable(curate) and again is curate; "
            "assert CurateConfig is run.CurateConfig and load_config.__module__ == 'datapipe.curation.config'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_worker_modules_are_the_users_files_not_installed_or_own_packages(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "user_filters_f", FILTER)
    entries = [StageConfig(path=f"{mod}:ShortDocs"), StageConfig(path="stages.quality:CodeFilter"),
               StageConfig(path="yaml:SafeLoader")]
    assert worker_modules(entries) == [str(tmp_path / "mods" / f"{mod}.py")]


@pytest.mark.cluster
def test_a_filter_in_a_file_of_the_users_runs_on_a_ray_cluster(tmp_path, two_node_cluster):
    address, env, _ = two_node_cluster
    mods, work = tmp_path / "mods", tmp_path / "work"  # the module is on the driver's path only, not the workers'
    mods.mkdir()
    work.mkdir()
    (mods / "cluster_user_filters.py").write_text(FILTER)
    recipe = _recipe(tmp_path, "[{path: 'cluster_user_filters:ShortDocs', args: {min_words: 200}}]")
    # selection by a model too: its model is fit in a task and read by the cluster's other tasks from the work folder
    cmd = [sys.executable, "-m", "datapipe", "curate", str(recipe), "--no-progress", "--ray-address", address,
           "--set", f"ray.stall_timeout_s={STALL_S}", "--set", "selection.method=classifier",
           "--set", f"selection.target.path={ASSETS / 'target_code.jsonl'}", "--set", "selection.keep_fraction=0.5"]
    done = subprocess.run(cmd, cwd=work, env={**env, "PYTHONPATH": str(mods)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    scores = pa.concat_tables([pq.read_table(f) for f in sorted((tmp_path / "out" / "selection" / "scores").glob("*.parquet"))])
    kept = set(scores.filter(scores.column("kept")).column("id").to_pylist())
    manifest = read_manifest(tmp_path / "out")
    trained = {i for s in manifest["shards"] for i in open_shard(tmp_path / "out", s["path"]).column("id").to_pylist()}
    assert kept and trained == kept and len(kept) < scores.num_rows
    assert stats["dropped"]["short_docs"] == {"code": {"short_docs:too_few_words": 7},
                                              "license": {"short_docs:too_few_words": 4},
                                              "man": {"short_docs:too_few_words": 5}}
    assert "short_docs" in [row["stage"] for row in stats["funnel"]]


def test_a_raising_filter_shipped_to_a_ray_cluster_is_named_at_the_user_s_own_file(tmp_path, two_node_cluster):
    """The module travels to the cluster's workers (Ray's copy of it runs there): the error names the line of the
    user's file as the driver has it, not Ray's copy under its session folder."""
    address, env, _ = two_node_cluster
    mods, work = tmp_path / "mods", tmp_path / "work"
    mods.mkdir()
    work.mkdir()
    (mods / "cluster_user_faulty.py").write_text(FAULTY)
    recipe = _recipe(tmp_path, "[{path: 'cluster_user_faulty:RaisesOn', args: {marker: 'GROUPDEL(8)'}}]")
    cmd = [sys.executable, "-m", "datapipe", "curate", str(recipe), "--no-progress", "--ray-address", address,
           "--set", f"ray.stall_timeout_s={STALL_S}"]
    done = subprocess.run(cmd, cwd=work, env={**env, "PYTHONPATH": str(mods)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"its check raised ValueError: cannot read this one ({mods / 'cluster_user_faulty.py'}, line 13, in check)" \
        in done.stderr, done.stderr[-3000:]
    assert "runtime_resources" not in done.stderr and "Traceback" not in done.stderr



FAULTY_GLOBAL = '''
import pyarrow as pa
from stages.base import GlobalStage


class FirstWord(GlobalStage):
    name = "first_word"
    partitions = 2

    def __init__(self, fault):
        self.fault = fault

    def keys(self, batch):
        words = [t.split(" ", 1)[0] for t in batch.column("text").to_pylist()]
        return pa.table({"word": words, "partition": pa.array([len(w) % 2 for w in words], pa.uint32()),
                         "order": batch.column("order"), "id": batch.column("id")})

    def decide(self, keys):
        if self.fault == "raise":
            raise ValueError("no decision")
        return pa.table({"order": keys.column("order")})  # not LOSER_SCHEMA
'''


@pytest.mark.ray_local
@pytest.mark.parametrize("fault", ["raise", "schema"])
def test_a_faulty_global_stage_on_ray_is_named_with_its_fault_not_a_worker_s_traceback(tmp_path, monkeypatch, request, fault):
    mod = _module(tmp_path, monkeypatch, "user_faulty_global", FAULTY_GLOBAL)
    stage = importlib.import_module(mod).FirstWord(fault)
    cfg = load_config(_recipe(tmp_path, "[]"))
    with pytest.raises(UserStageFailed if fault == "raise" else ConfigError) as failed:
        _run_extra(cfg, [stage], _executor("ray", request, mod))
    message = str(failed.value)
    head = rf"extra_stages\[0\]: global stage 'first_word'"
    if fault == "raise":
        assert re.match(rf"{head} \({mod}\.FirstWord\), on a batch of \d+ documents .*: decide raised ValueError: no "
                        rf"decision \({re.escape(str(tmp_path / 'mods' / f'{mod}.py'))}, line \d+, in decide\)", message), message
    else:
        assert re.match(rf"{head}: decide returned order: int64; it returns a pyarrow Table of stages.base.LOSER_SCHEMA", message), message
    assert "Traceback" not in message and "RayTaskError" not in message
