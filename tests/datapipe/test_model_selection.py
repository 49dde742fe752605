"""Selection by a model in a curation run: the exact cut to a token budget, the scores it publishes, resume, identity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ASSETS, small_config
from datapipe.core.config import ConfigError
from datapipe.core.shards import open_shard, read_manifest
from datapipe.curation.executors import LocalExecutor
from datapipe.curation.identity import RunConflict
from datapipe import curate
from stages.selection import SelectionModel

SLICE = {"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}
BUDGET = 6000  # tokens: about a third of the slice's training tokens under the test tokenizer


def _config(out: Path, target: Path | None = ASSETS / "target_code.jsonl", **selection):
    selection = {"method": "dsir", "keep_tokens": BUDGET, **selection}
    if target is not None and "model" not in selection:
        selection["target"] = {"path": str(target)}
    return small_config(out, [SLICE], normalize={"enabled": False}, selection=selection,
                        eval={"enabled": True, "fraction": 0.1})


def _run(cfg, executor=None):
    return curate(cfg, executor=executor or LocalExecutor(), progress=False, log=lambda *_: None)


def _scores(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted((out / "selection" / "scores").glob("*.parquet"))])


def _trained_ids(out: Path) -> list[str]:
    manifest = read_manifest(out)
    return [i for s in manifest["shards"] for i in open_shard(out, s["path"]).column("id").to_pylist()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("selected") / "out"
    _run(_config(out))
    return out


def test_the_budget_keeps_the_best_scored_documents_until_it_is_full(finished: Path) -> None:
    scores = _scores(finished).to_pandas().sort_values("score", ascending=False)
    cumulative = scores["num_tokens"].cumsum().to_numpy()
    kept = scores["kept"].to_numpy()
    n = int(kept.sum())
    assert kept[:n].all() and not kept[n:].any()  # a prefix by score
    assert cumulative[n - 2] < BUDGET <= cumulative[n - 1]  # full: the last kept document crosses the budget
    assert sorted(_trained_ids(finished)) == sorted(scores["id"][kept])  # the shards hold exactly the kept ones
    report = json.loads((finished / "stats.json").read_text())["model_selection"]["groups"]["*"]
    assert report["tokens_kept"] == cumulative[n - 1] and report["budget_tokens"] == BUDGET


def test_the_shards_carry_each_document_s_score_and_the_loader_reads_them(finished: Path) -> None:
    from datapipe.loader import PackedLoader

    manifest = read_manifest(finished)
    shards = pa.concat_tables([open_shard(finished, s["path"]) for s in manifest["shards"]])
    published = dict(zip(_scores(finished).column("id").to_pylist(), _scores(finished).column("score").to_pylist()))
    assert shards.column("selection_score").to_pylist() == [published[i] for i in shards.column("id").to_pylist()]
    batch = next(iter(PackedLoader(str(finished), seq_len=64, batch_size=2)))
    assert batch["input_ids"].shape == (2, 64)


def test_the_published_scores_are_the_saved_model_s_scores_of_the_documents(finished: Path) -> None:
    model = SelectionModel.from_bytes((finished / "selection" / "model.npz").read_bytes())
    texts = {d["id"]: d["text"] for d in map(json.loads, (ASSETS / "corpus_slice.jsonl").read_text().splitlines())}
    scores = _scores(finished)
    ids = scores.column("id").to_pylist()
    assert np.allclose(model.scores([texts[i] for i in ids], ids), scores.column("score").to_numpy())


def test_eval_documents_are_never_scored_and_drops_are_counted_under_the_method(finished: Path) -> None:
    eval_ids = set(_trained_ids(finished / "eval"))
    assert eval_ids and not eval_ids & set(_scores(finished).column("id").to_pylist())
    stats = json.loads((finished / "stats.json").read_text())
    dropped = sum(n for _, stage, _, reason, n in stats["counters"]["dropped"] if stage == "dsir" and reason == "dsir:below_cut")
    assert dropped == int((~_scores(finished).column("kept").to_numpy()).sum())
    report = stats["model_selection"]
    assert report["flops"] > 0
    for domain, h in report["histogram"]["domains"].items():
        mine = _scores(finished).filter(pa.compute.equal(_scores(finished).column("domain"), domain))
        assert sum(h["all"]) == mine.num_rows and sum(h["kept"]) == int(mine.column("kept").to_numpy().sum())


def test_other_blocks_and_a_saved_model_make_the_same_choice(finished: Path, tmp_path: Path) -> None:
    """The cut is exact whatever the blocks (one block here against many there), and a model saved by one run
    (`selection.model`) scores as it did there."""
    cfg = _config(tmp_path / "out", target=None, model=str(finished / "selection" / "model.npz"))
    cfg = small_config(tmp_path / "out", [SLICE], normalize={"enabled": False}, read={"block_bytes": 1 << 20},
                       selection=json.loads(json.dumps(cfg.selection.__dict__, default=lambda o: o.__dict__)),
                       eval={"enabled": True, "fraction": 0.1})
    _run(cfg)
    assert sorted(_trained_ids(tmp_path / "out")) == sorted(_trained_ids(finished))


class _StopInSelection(LocalExecutor):
    """Runs one task of the selection's apply step, then stops the run (a kill there)."""

    def run_tasks(self, fn, shared, items, desc, *, memory=None):
        if desc.endswith("selection apply") and len(items) > 1:
            fn(shared, *items[0])
            raise KeyboardInterrupt
        return super().run_tasks(fn, shared, items, desc, memory=memory)


def test_a_run_killed_in_selection_resumes_to_the_same_shards(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(_config(out), executor=_StopInSelection())
    _run(_config(out))
    assert [s["sha256"] for s in read_manifest(out)["shards"]] == [s["sha256"] for s in read_manifest(finished)["shards"]]


def test_per_domain_fraction_and_threshold(tmp_path: Path) -> None:
    _run(_config(tmp_path / "a", method="classifier", keep_tokens=None, keep_fraction=0.5, per_domain=True))
    scores = _scores(tmp_path / "a").to_pandas()
    for _, rows in scores.groupby("domain"):  # each domain full: its kept documents but the last fall short of half
        rows = rows.sort_values("score", ascending=False)
        kept = rows["num_tokens"][rows["kept"]].to_numpy()
        assert kept[:-1].sum() < 0.5 * rows["num_tokens"].sum() <= kept.sum()
    threshold = float(np.median(scores["score"]))
    _run(_config(tmp_path / "b", method="classifier", keep_tokens=None, threshold=threshold))
    again = _scores(tmp_path / "b").to_pandas()
    assert (again["kept"] == (again["score"] >= threshold)).all() and again["kept"].any() and not again["kept"].all()


def test_domain_tokens_fill_each_named_domain_s_budget_and_keep_none_of_the_others(tmp_path: Path) -> None:
    """Random at per-domain budgets (a mixture-matched control): each named domain full, one not named kept out."""
    budgets = {"man": 3000, "code": 1500}
    _run(_config(tmp_path / "a", target=None, method="random", keep_tokens=None, domain_tokens=budgets))
    scores = _scores(tmp_path / "a").to_pandas()
    assert set(scores["domain"]) - set(budgets)  # the slice has a domain the budgets leave out
    for domain, rows in scores.groupby("domain"):
        kept = rows.sort_values("score", ascending=False)["num_tokens"][rows["kept"]].to_numpy()
        if domain not in budgets:
            assert len(kept) == 0
        else:
            assert kept[:-1].sum() < budgets[domain] <= kept.sum()
    with pytest.raises(ConfigError, match=r"domain_tokens names domains .*\['mann'\]"):
        _run(_config(tmp_path / "b", target=None, method="random", keep_tokens=None, domain_tokens={"mann": 10}))


def test_an_edited_target_refuses_the_folder_and_a_missing_one_is_named(finished: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.jsonl"
    shutil.copy(ASSETS / "target_code.jsonl", target)
    out = tmp_path / "out"
    _run(_config(out, target=target))
    target.write_text(target.read_text() + json.dumps({"id": "new", "text": "def f(): pass"}) + "\n")
    with pytest.raises(RunConflict, match="target.jsonl"):
        _run(_config(out, target=target))
    with pytest.raises(ConfigError, match=r"selection.target \('.*nope.jsonl'\)"):
        _run(_config(tmp_path / "other", target=tmp_path / "nope.jsonl"))



def _ray():
    from helpers import STALL_S
    from datapipe.curation.executors import RayExecutor

    return RayExecutor(progress=False, stall_timeout_s=STALL_S)


def test_a_kill_between_the_model_s_two_writes_still_leaves_the_model_for_later_runs(
        finished: Path, tmp_path: Path, monkeypatch) -> None:
    """The fit task is stopped right after the first of the model's two files is written, before its record; the
    resumed run fits again and finishes with OUT/selection/model.npz, the model the uninterrupted run saved. (In this
    process: the patched write is the fit task's, which on Ray runs in a worker.)"""
    from datapipe.curation.phases import model_selection

    written, write = [], model_selection.atomic_write_bytes

    def stop_after_the_first(path, data):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        write(path, data)

    out = tmp_path / "out"
    monkeypatch.setattr(model_selection, "atomic_write_bytes", stop_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        _run(_config(out))
    assert written == [out / "selection" / "model.npz"] and not (out / "work" / "model_select" / "records" / "fit.json").exists()
    monkeypatch.setattr(model_selection, "atomic_write_bytes", write)
    _run(_config(out))
    again = SelectionModel.from_bytes((out / "selection" / "model.npz").read_bytes())
    before = SelectionModel.from_bytes((finished / "selection" / "model.npz").read_bytes())
    assert again.method == before.method and np.array_equal(again.knots, before.knots)


class _Recording(LocalExecutor):
    """The local executor, noting each step's name, task count, declared memory and results; it stops the run (a
    kill) as `stop_at` starts."""

    def __init__(self, stop_at: str | None = None) -> None:
        super().__init__()
        self.stop_at, self.steps = stop_at, []

    def run_tasks(self, fn, shared, items, desc, *, memory=None):
        if self.stop_at is not None and desc.endswith(self.stop_at):
            raise KeyboardInterrupt
        results = super().run_tasks(fn, shared, items, desc, memory=memory)
        self.steps.append((desc, getattr(fn, "__name__", ""), len(items), memory, results))
        return results


def test_the_fit_is_one_recorded_task_and_no_document_reaches_the_driver(finished: Path, tmp_path: Path) -> None:
    """The sample goes to work files (a task's result holds counts only) and the fit is one task that leaves its
    record; killed as scoring starts, the resumed run finds the fit done by that record (its model files stay as they
    were) and writes the uninterrupted run's shards."""
    out = tmp_path / "out"
    first = _Recording(stop_at="selection score")
    with pytest.raises(KeyboardInterrupt):
        _run(_config(out), first)
    steps = {desc: (fn, n, results) for desc, fn, n, _, results in first.steps}
    assert steps["selection sample"][2] and all(len(json.dumps(r)) < 200 for r in steps["selection sample"][2])
    assert steps["selection fit"][:2] == ("fit_task", 1) and steps["selection fit"][2][0][1] is False
    model_files = [out / "selection" / "model.npz", out / "work" / "model_select" / "model.npz"]
    fitted = [p.read_bytes() for p in model_files]
    again = _Recording()
    _run(_config(out), again)
    (fit,) = [results for desc, _, _, _, results in again.steps if desc == "selection fit"]
    assert fit[0][1] is True and fit[0][0] == steps["selection fit"][2][0][0]  # found done: its record's result
    assert [p.read_bytes() for p in model_files[:1]] == fitted[:1]
    assert [s["sha256"] for s in read_manifest(out)["shards"]] == [s["sha256"] for s in read_manifest(finished)["shards"]]


def test_a_model_file_without_its_record_is_fitted_again(finished: Path, tmp_path: Path) -> None:
    """Killed as scoring starts, the fit's record deleted and another sound model put in its place (a file a plain
    exists() check would trust): the resumed run fits again and writes the uninterrupted run's shards."""
    import dataclasses

    from datapipe.core.workfiles import checked

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        _run(_config(out), _Recording(stop_at="selection score"))
    work = out / "work" / "model_select"
    (work / "records" / "fit.json").unlink(missing_ok=True)
    other = dataclasses.replace(SelectionModel.from_bytes((finished / "selection" / "model.npz").read_bytes()), seed=7)
    (work / "model.npz").write_bytes(checked(other.to_bytes()))
    _run(_config(out))
    assert [s["sha256"] for s in read_manifest(out)["shards"]] == [s["sha256"] for s in read_manifest(finished)["shards"]]
    assert SelectionModel.from_bytes((out / "selection" / "model.npz").read_bytes()).seed == 0


def _saved_model(finished: Path, tmp_path: Path, damage) -> Path:
    path = tmp_path / "model.npz"
    path.write_bytes(damage((finished / "selection" / "model.npz").read_bytes()))
    return path


def _flip_a_bit(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x10
    return bytes(damaged)


def test_a_damaged_or_foreign_model_file_is_refused_before_any_work_naming_it(finished: Path, tmp_path: Path) -> None:
    """selection.model: one flipped bit, a cut, a model whose inner arrays are another method's, a model of another
    method: each a ConfigError naming the file and what to do, at planning (no output folder claimed)."""
    import io

    from stages.selection import INNER_KINDS

    def other_inner(data: bytes) -> bytes:  # a DSIR file holding a classifier's arrays
        with np.load(io.BytesIO(data)) as f:
            arrays = {k: f[k] for k in f.files}
        arrays["model"] = np.frombuffer(INNER_KINDS["classifier"][1](np.zeros(4, np.float32), 0.0).to_bytes(), np.uint8)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    cases = {"bit": (_flip_a_bit, "dsir", "not a readable .npz file"), "cut": (lambda d: d[: len(d) // 2], "dsir", "not a readable"),
             "inner": (other_inner, "dsir", "its method is 'dsir' but it holds a 'quality_classifier' model"),
             "method": (lambda d: d, "classifier", "is a 'dsir' model, not 'classifier'; set selection.method=dsir")}
    for name, (damage, method, reason) in cases.items():
        model = _saved_model(finished, tmp_path / name, damage) if (tmp_path / name).mkdir() is None else None
        out = tmp_path / name / "out"
        with pytest.raises(ConfigError, match=rf"selection.model: '{model}' .*{reason}.*(earlier run saved|to use it)"):
            _run(_config(out, target=None, method=method, model=str(model)))
        assert not (out / "run.json").exists()


def test_a_target_without_text_is_refused_at_planning_and_the_fixed_target_then_runs(tmp_path: Path, ray_local) -> None:
    """On Ray: an empty target, then one whose documents have blank text, are refused before the run claims its
    folder; after the user writes documents into it, the same command runs."""
    target, out = tmp_path / "target.jsonl", tmp_path / "out"
    for content in ("", json.dumps({"id": "a", "text": " \n"}) + "\n"):
        target.write_text(content)
        with pytest.raises(ConfigError, match=r"selection.target: '.*target.jsonl' holds no document"):
            _run(_config(out, target=target), executor=_ray())
        assert not (out / "run.json").exists()
    shutil.copy(ASSETS / "target_code.jsonl", target)
    _run(_config(out, target=target), executor=_ray())
    assert (out / "selection" / "model.npz").exists()


def test_datapipe_curate_with_a_fasttext_model_on_ray_keeps_by_the_model_s_own_scores(tmp_path: Path, ray_local) -> None:
    """The user's path: `datapipe curate ... --set selection.method=fasttext --set selection.model=model.bin` on a
    Ray cluster (the session's, whose workers run in another folder), the model file named relative to the driver's
    working folder: every published score is the binding's own probability of `__label__hq` for that document, and
    the kept ones are the best scored."""
    import subprocess
    import sys

    import fasttext

    from tiny_fasttext import train

    train(tmp_path / "ft")
    (tmp_path / "c.yaml").write_text(f"inputs: [{{path: '{ASSETS / 'corpus_slice.jsonl'}', domain_field: source}}]\n"
                                     "normalize: {enabled: false}\ntokenizer: {train: {vocab_size: 400}}\n")
    address = ray_local.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "datapipe", "curate", "c.yaml", "--no-progress", "--output", "out",
                           "--ray-address", address, "--set", "selection.method=fasttext", "--set", "selection.model=ft/model.bin",
                           "--set", f"selection.keep_tokens={BUDGET}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    model = fasttext.load_model(str(tmp_path / "ft" / "model.bin"))
    texts = {d["id"]: d["text"] for d in map(json.loads, (ASSETS / "corpus_slice.jsonl").read_text().splitlines())}
    scores = _scores(tmp_path / "out").to_pandas()
    for doc_id, score in zip(scores["id"], scores["score"]):
        labels, probabilities = model.predict(texts[doc_id].replace("\n", " "), k=2)
        assert score == pytest.approx(float(probabilities[list(labels).index("__label__hq")]), abs=1e-6)
    ordered = scores.sort_values("score", ascending=False)
    assert ordered["kept"].to_numpy()[: int(ordered["kept"].sum())].all() and 0 < ordered["kept"].sum() < len(ordered)


def test_a_fasttext_model_that_is_not_a_local_file_is_refused_at_planning(tmp_path: Path) -> None:
    """fastText reads local files: an object-store URL or a missing file is named before any work."""
    for model in ("s3://bucket/model.bin", str(tmp_path / "missing.bin")):
        cfg = _config(tmp_path / "out", target=None, method="fasttext", model=model)
        with pytest.raises(ConfigError, match=rf"selection.model: '{model}' .*is not a file on this machine"):
            _run(cfg)
        assert not (tmp_path / "out" / "run.json").exists()


def test_a_cut_fasttext_model_is_one_paragraph_at_planning_and_the_intact_file_restored_resumes(tmp_path: Path) -> None:
    """A model file cut to half loads but cannot classify: named before any work, the folder not claimed, so the
    same command with the intact file put back runs."""
    from tiny_fasttext import train

    model = train(tmp_path / "ft")
    intact = model.read_bytes()
    model.write_bytes(intact[: len(intact) // 2])
    cfg = _config(tmp_path / "out", target=None, method="fasttext", model=str(model))
    with pytest.raises(ConfigError, match=rf"selection.model: '{model}' is not a fastText classifier datapipe can use: "
                       r"it loads but cannot classify a line \(.*\): the file is damaged or cut short"):
        _run(cfg)
    assert not (tmp_path / "out" / "run.json").exists()
    model.write_bytes(intact)
    _run(cfg)
    assert (tmp_path / "out" / "manifest.json").exists()


def test_a_fasttext_model_s_tasks_declare_its_file_s_memory(tmp_path: Path) -> None:
    """The tasks that load a fastText model (the fit, which scores the sample, and the scoring) ask for their block's
    memory plus the model file's size; the tasks that do not load it (apply) ask for the block's alone."""
    import os

    from tiny_fasttext import train

    model = train(tmp_path / "ft")
    executor = _Recording()
    _run(_config(tmp_path / "out", target=None, method="fasttext", model=str(model)), executor)
    memory = {desc: declared for desc, _, _, declared, _ in executor.steps}
    assert memory["selection apply"] > 0
    assert memory["selection score"] == memory["selection apply"] + os.path.getsize(model)
    assert memory["selection fit"] >= memory["selection apply"] + os.path.getsize(model)


def test_the_ray_executor_gives_a_task_the_memory_it_declares(ray_local) -> None:
    """What a phase declares (`memory=`) is the Ray `memory` resource its task holds while it runs."""

    def assigned(_shared):
        import ray

        return ray.get_runtime_context().get_assigned_resources()

    declared = 300 * 2**20
    (resources,) = _ray().run_tasks(assigned, None, [()], "probe", memory=declared)
    assert resources.get("memory") == declared and resources.get("CPU") == 1
    (resources,) = _ray().run_tasks(assigned, None, [()], "probe")
    assert "memory" not in resources


@pytest.mark.ray_local
def test_the_local_and_ray_executors_give_the_same_shards_with_a_fitted_classifier(tmp_path: Path, ray_local) -> None:
    """The classifier fit in this process (the BLAS threads it has) and in a Ray worker (one thread): the same
    model file, bit for bit (it keeps no time), so the same selection and the same shards."""
    from datapipe.curation.executors import RayExecutor

    local, on_ray = tmp_path / "local", tmp_path / "ray"
    _run(_config(local, method="classifier"))
    _run(_config(on_ray, method="classifier"), RayExecutor(progress=False))
    assert (local / "selection" / "model.npz").read_bytes() == (on_ray / "selection" / "model.npz").read_bytes()
    assert [s["sha256"] for s in read_manifest(on_ray)["shards"]] == [s["sha256"] for s in read_manifest(local)["shards"]]

