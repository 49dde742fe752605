"""The package's layers are a rule the build checks (import-linter), and docs/layout.md names every module."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_a_planted_violating_import_breaks_the_contract(tmp_path):
    for name in ("datapipe", "stages"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    schema = tmp_path / "datapipe" / "core" / "schema.py"
    schema.write_text(schema.read_text() + "\nfrom datapipe.train import model  # planted: core must not import train\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert re.search(r"core imports nothing else of ours\s+BROKEN", done.stdout), done.stdout


def test_the_layout_doc_is_the_tree():
    from scripts.layout import LAYOUT_DOC, readme_section, render

    section = readme_section((ROOT / LAYOUT_DOC).read_text())
    assert section is not None, f"{LAYOUT_DOC} lost its layout markers"
    assert section == render(), f"{LAYOUT_DOC}'s listing is stale: run `python -m scripts.layout --write`"


def _nodes():
    """(path below the root, node) of every syntax node of every module in datapipe/ and stages/."""
    for package in ("datapipe", "stages"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                yield path.relative_to(ROOT), node


def test_no_function_in_datapipe_or_stages_is_over_80_lines():
    """A function fits on a screen: 80 lines, its signature and docstring included."""
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)" for path, node in _nodes()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, "\n".join(long)


def test_no_record_is_checked_outside_the_run_loop():
    """Resume is done once: only `phase.recorded_task` (which the run loop alone calls) reads or writes a task's
    record; a phase that needs a choice kept across resumes makes it a recorded task."""
    found = [(str(path), node.lineno) for path, node in _nodes()  # a call or a reference (a partial)
             if getattr(node, "id", getattr(node, "attr", None)) in ("read_record", "write_record", "recorded_task")]
    allowed = {"datapipe/curation/phase.py", "datapipe/curation/run_loop.py"}
    assert found and not [f for f in found if f[0] not in allowed], found


def test_the_run_is_a_list_of_steps_over_a_frozen_state_and_only_the_exchange_writes_shuffle_files():
    """`curate()` is a loop over `steps.STEPS`, each `step(run, plan, state) -> state` over a frozen `RunState`; and a
    shuffle file is written, planned or routed only in core/exchange.py (every phase goes through its `Shuffle`)."""
    import dataclasses
    import inspect

    from datapipe.curation import run, steps

    assert len(inspect.getsource(run.curate).splitlines()) <= 40
    assert all(list(inspect.signature(step).parameters) == ["run", "plan", "state"] for step in steps.STEPS)
    assert steps.RunState.__dataclass_params__.frozen
    state = steps.RunState(started=0.0)
    try:
        state.blocks = ((0, 0),)
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("RunState can be changed in place")
    for path in [*(ROOT / "datapipe").rglob("*.py"), *(ROOT / "stages").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if path.name in ("exchange.py", "shuffle.py") and path.parent.name == "core":
            continue
        calls = re.findall(r"(?<![\w.])(write_shuffle|Exchange|route)\(", path.read_text())
        assert not calls, f"{path.relative_to(ROOT)} calls {sorted(set(calls))}: send and route through exchange.Shuffle"


def test_the_phases_import_each_other_along_at_most_four_arrows():
    """What several phases share lives outside phases/ (the cuts, the map stages, the stage list, the folder names):
    a phase imports another only where it uses that phase's own work (the eval split near dedup's keys, the read
    and the first segment the renames, selection the model's)."""
    arrows = set()
    for path in (ROOT / "datapipe" / "curation" / "phases").glob("*.py"):
        for line in path.read_text().splitlines():
            if (m := re.match(r"\s*from datapipe\.curation\.phases(?:\.(\w+))? import (.*)", line)):
                arrows |= {(path.stem, t) for t in ([m.group(1)] if m.group(1) else [x.strip() for x in m.group(2).split(",")])}
    assert len(arrows) <= 4, sorted(arrows)
