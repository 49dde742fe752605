"""The run's identity, `OUT/run.json`: claim an output folder, refuse one that holds another run, reuse a finished one.

`run.json` keeps what decides the output (the config, the input units, each input file's fingerprint, a loaded
tokenizer's sha256) and the work layout the run was started with. A rerun that is not the same run is refused
and told which keys or files differ; an unfinished run resumed with another work layout is refused too.

`run.json` is written durably, and while `work/` is there a checked copy of it stays there (`work/run.json`): a
run.json that a power loss or a hand edit left cut, emptied, changed or deleted is written again from the copy. Where
there is no copy to trust (a finished run's work/ is gone), the run stops with a paragraph saying how to recover.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from datapipe.core.config import ConfigError
from datapipe.core.shards import atomic_write_bytes, atomic_write_json
from datapipe.core.storage import is_url, remove_tree
from datapipe.core.workfiles import DamagedWorkFile, checked, read_work_bytes
from datapipe.curation.config import SelectionConfig, config_hash, diff_configs, layout_conflict, result_affecting, work_layout
from datapipe.curation.plan import Plan
from datapipe.curation.readers import file_fingerprint, input_fingerprints, plan_units


RUN_RECORD = "run.json"


class RunConflict(ConfigError):
    """The output folder holds a run made with a different config or different inputs."""


def run_record(plan: Plan, tokenizer_text: str | None) -> dict[str, Any]:
    """The run's identity, kept in OUT/run.json: what decides the output (the config, the input units,
    each input file's fingerprint, the loaded tokenizer's sha256) and the work layout it was started with."""
    record = {
        "config": result_affecting(plan.cfg),
        "config_hash": config_hash(plan.cfg),
        "units": [dataclasses.asdict(u) for u in plan.units],
        "input_files": {**input_fingerprints(plan.units, list(plan.cfg.inputs)), **_selection_files(plan.cfg.selection)},
        "work_layout": work_layout(plan.cfg),
    }
    if tokenizer_text is not None:
        record["tokenizer_sha256"] = hashlib.sha256(tokenizer_text.encode()).hexdigest()
    return json.loads(json.dumps(record))  # as it reads back from the file (tuples are lists)


def _selection_files(cfg: SelectionConfig) -> dict[str, dict[str, Any]]:
    """Fingerprints of what selection by a model reads besides the inputs: its target documents or its model file."""
    if not cfg.enabled:
        return {}
    if cfg.target is not None:
        return input_fingerprints(plan_units([cfg.target], "selection.target"), [cfg.target])
    return {cfg.model: file_fingerprint(cfg.model)} if cfg.model is not None else {}


def _unit_paths(units: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(f for u in units for f in (u["files"] or [u["path"]])))


def _identity_conflict(plan: Plan, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why the run recorded in `old` is not the run `new` describes, or None when it is."""
    out = plan.out_dir
    if old["config_hash"] != new["config_hash"] or old["units"] != new["units"]:
        diffs = diff_configs(old["config"], new["config"])
        if old["units"] != new["units"]:
            before, now = _unit_paths(old["units"]), _unit_paths(new["units"])
            gone, added = [p for p in before if p not in now], [p for p in now if p not in before]
            detail = "; ".join(
                part for part in (f"no longer found: {gone[:3]}" if gone else "", f"new: {added[:3]}" if added else "") if part
            ) or "the same files, cut into other units (a dataset's row count changed?)"
            diffs.append(f"inputs: the input files differ ({detail})")
        return (f"output folder {out} holds a run made with a different config: " + "; ".join(diffs[:10])
                + ". Use another --output, or delete the folder.")
    old_files = old.get("input_files", {})  # absent in a record written before fingerprints were kept
    for path, fingerprint in new["input_files"].items():
        if path in old_files and old_files[path] != fingerprint:
            was, now = old_files[path], fingerprint
            change = (f"size {was['size']:,} -> {now['size']:,} bytes" if was.get("size") != now.get("size")
                      else "same size, modified since")
            return (f"input file {path!r} changed since the run in output folder {out} started ({change}); "
                    "the work already done there read the old version. Restore the file as it was, or curate "
                    "the new version into another --output (or delete the folder).")
    if "tokenizer_sha256" in old and old["tokenizer_sha256"] != new.get("tokenizer_sha256"):
        return (f"tokenizer.path {plan.cfg.tokenizer.path!r} changed since the run in output folder {out} started "
                f"(sha256 {old['tokenizer_sha256'][:12]}... -> {str(new.get('tokenizer_sha256'))[:12]}...); documents "
                "already tokenized there used the old tokenizer. Restore the file as it was, or use another "
                "--output (or delete the folder).")
    return None


def check_output(plan: Plan, tokenizer_text: str | None = None) -> dict[str, Any] | None:
    """Refuse an output folder holding another run (another config, other or edited inputs, another
    tokenizer, or, unfinished, another work layout); return its manifest if already complete."""
    out = plan.out
    record = run_record(plan, tokenizer_text)
    old = _recorded_identity(plan)
    if old is None:  # a new run: work/ without an identity (none ever written, or gone) cannot be trusted
        remove_tree(plan.work)
        atomic_write_json(out / RUN_RECORD, record, durable=True)
        _write_copy(plan, record)
        return None
    if (conflict := _identity_conflict(plan, old, record)) is not None:
        raise RunConflict(conflict)
    manifest = out / "manifest.json"
    if manifest.exists():
        return _finished_manifest(plan)
    if (conflict := layout_conflict(plan.out_dir, old.get("work_layout", {}), record["work_layout"])) is not None:
        raise RunConflict(conflict)
    if _read_copy(plan) is None:  # killed between run.json and its copy
        _write_copy(plan, old)
    return None


def _finished_manifest(plan: Plan) -> dict[str, Any]:
    """A finished run's manifest, its stats.json read too (a rerun reports both): a paragraph saying how to recover
    when either is damaged or gone, rather than json's traceback."""
    read = {}
    for name in ("manifest.json", "stats.json"):
        try:
            read[name] = json.loads((plan.out / name).read_bytes())
        except (OSError, ValueError) as exc:
            raise RunConflict(
                f"output folder {plan.out_dir} holds a finished run whose {name} is damaged or gone "
                f"({type(exc).__name__}: {exc}). To recover, delete {plan.out_dir}/manifest.json and run the same "
                "command again: the run redoes its work from the inputs and writes the same output.") from None
    return read["manifest.json"]


_IDENTITY_KEYS = ("config", "config_hash", "units")


def _write_copy(plan: Plan, record: dict[str, Any]) -> None:
    """run.json's checked copy in work/ (a work file: its length and digest in its trailer)."""
    atomic_write_bytes(plan.work / RUN_RECORD, checked(json.dumps(record, sort_keys=True).encode()))


def _read_copy(plan: Plan) -> dict[str, Any] | None:
    """run.json's copy in work/, None when it is gone or damaged."""
    try:
        return json.loads(read_work_bytes(plan.work / RUN_RECORD).to_pybytes())
    except (DamagedWorkFile, ValueError):
        return None


def _recorded_identity(plan: Plan) -> dict[str, Any] | None:
    """The identity of the run the output folder holds (OUT/run.json, written again from its checked copy in work/
    when it is damaged or gone), None when it holds no run's files; a RunConflict saying how to recover when the
    folder holds a run's files but no identity that can be read."""
    out = plan.out
    copy = _read_copy(plan)
    try:
        found = json.loads((out / RUN_RECORD).read_bytes())
        problem = None if isinstance(found, dict) and all(k in found for k in _IDENTITY_KEYS) else "not a run's record"
    except FileNotFoundError:
        found, problem = None, "it is missing"
    except ValueError as exc:  # cut, emptied or changed (json's errors are ValueErrors, UnicodeDecodeError too)
        found, problem = None, f"it does not read as JSON ({exc})"
    if copy is not None:
        if found != copy:
            atomic_write_json(out / RUN_RECORD, copy, durable=True)
        return copy
    if problem is None:
        return found
    others = [p.name for p in out.iterdir() if p.name != "work"] if out.exists() else []
    if found is None and not others and problem == "it is missing":
        return None
    if problem == "it is missing" and not any(name in others for name in _RUN_FILES):
        raise RunConflict(f"output folder {plan.out_dir} is not empty and holds no {RUN_RECORD}; use an empty folder")
    remove = f"rm -r {plan.out_dir}" if not is_url(plan.out_dir) else f"delete every object under {plan.out_dir}"
    raise RunConflict(
        f"{plan.out_dir}/{RUN_RECORD} is damaged: {problem}. It says which config and inputs made the files in "
        f"{plan.out_dir}, and without it they cannot be checked against this run's. To recover, {remove} and run the "
        "same command again: the run redoes its work from the inputs and writes the same output (or use another "
        "--output).")


_RUN_FILES = ("manifest.json", "stats.json", "tokenizer.json", "shards", "dropped", "eval")  # a run wrote here
