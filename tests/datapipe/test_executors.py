"""Progress output written to a file or a CI log is plain lines, never carriage-return-joined bar frames."""

from datapipe.curate import executors
from datapipe.curate.executors import LocalExecutor


def _double(_, x):
    return 2 * x


def test_progress_to_a_log_is_plain_periodic_lines(capsys, monkeypatch):
    clock = iter(float(t) for t in range(0, 1000, 4))  # every task "takes" 4 s: a line every ~3rd task
    monkeypatch.setattr(executors.time, "monotonic", lambda: next(clock))
    out = LocalExecutor(progress=True).run_tasks(_double, None, [(i,) for i in range(10)], "exact_dedup")
    assert out == [2 * i for i in range(10)]
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and all(line.startswith("exact_dedup: ") for line in lines)
    assert lines[0] == "exact_dedup: 10 tasks" and lines[-1].startswith("exact_dedup: 10/10 tasks done in")
    assert 2 <= len(lines) - 2 <= 4  # periodic lines in between, not one per task


def test_no_progress_prints_nothing(capsys):
    LocalExecutor(progress=False).run_tasks(_double, None, [(1,), (2,)], "tokenize")
    assert capsys.readouterr().err == ""
