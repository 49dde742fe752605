"""The public API: `datapipe.curate` is an ordinary function, and `datapipe` exports the result and error types."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import datapipe

ROOT = Path(__file__).resolve().parents[2]


def test_curate_is_a_plain_function_with_its_own_signature():
    assert inspect.isfunction(datapipe.curate) and datapipe.curate.__module__ == "datapipe.curation.run"
    assert list(inspect.signature(datapipe.curate).parameters) == ["cfg", "executor", "extra_stages", "progress",
                                                                   "verbose", "log"]
    done = subprocess.run([sys.executable, "-c", "import datapipe, inspect; print(inspect.signature(datapipe.curate))"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("(cfg"), done.stderr


def test_the_result_and_error_types_are_exported_and_are_what_the_run_raises():
    from datapipe.core.config import ConfigError, RunStopped
    from datapipe.curation.identity import RunConflict
    from datapipe.curation.report import NothingSurvived

    assert {"curate", "CurateResult", "ConfigError", "RunStopped", "RunConflict", "NothingSurvived",
            "DamagedWorkFile"} <= set(datapipe.__all__) <= set(dir(datapipe))
    assert datapipe.NothingSurvived is NothingSurvived and issubclass(datapipe.NothingSurvived, RunStopped)
    assert datapipe.RunConflict is RunConflict and issubclass(datapipe.RunConflict, ConfigError)


def test_no_module_of_the_package_assigns_a_module_class():
    for path in (ROOT / "datapipe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                assert not any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets), path
