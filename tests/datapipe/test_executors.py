"""Progress output written to a file or a CI log is plain lines, never carriage-return-joined bar frames."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ASSETS, STALL_S, small_config
from datapipe.curation import executors
from datapipe.curation.executors import _embedded, _progress, _ray_executor
from datapipe.curation.executors import LocalExecutor, PhaseStalled, RayExecutor


def _double(_, x):
    return 2 * x


def test_progress_to_a_log_is_plain_periodic_lines(capsys, monkeypatch):
    clock = iter(float(t) for t in range(0, 1000, 4))  # every task "takes" 4 s: a line every ~3rd task
    monkeypatch.setattr(_progress.time, "monotonic", lambda: next(clock))
    out = LocalExecutor(progress=True).run_tasks(_double, None, [(i,) for i in range(10)], "exact_dedup")
    assert out == [2 * i for i in range(10)]
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and all(line.startswith("exact_dedup: ") for line in lines)
    assert lines[0] == "exact_dedup: 10 tasks" and lines[-1].startswith("exact_dedup: 10/10 tasks done in")
    assert 2 <= len(lines) - 2 <= 4  # periodic lines in between, not one per task


def test_a_run_in_a_terminal_shows_a_live_bar_per_stage_ticked_by_every_task(capsys, monkeypatch, tmp_path, slice_input):
    """stderr a terminal: each stage's bar counts every task of its phases (tasks done / total, rate), the executor's
    own per-phase bars off; no stage's plain line besides."""
    from helpers import small_config
    from datapipe import curate

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    curate(small_config(tmp_path / "out", [slice_input]), executor=LocalExecutor(), log=lambda _: None)
    err = capsys.readouterr().err
    finals = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"\s*([a-z ]+): 100%\|[^|]*\| (\d+)/(\d+) \[[^\]]*task/s\]", err)}
    assert {"read", "filters", "tokenize", "shards"} <= set(finals), err[-2000:]
    assert all(done == total > 0 for done, total in finals.values())
    assert not re.search(r"^\w[\w ]*: \d+ tasks? in \d", err, re.M)  # the bars are the lines


def test_no_progress_prints_nothing(capsys):
    LocalExecutor(progress=False).run_tasks(_double, None, [(1,), (2,)], "tokenize")
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------ the stall watchdog (Ray)


def nap(_, seconds):
    time.sleep(seconds)


@pytest.fixture
def ray_here(ray_local):
    """The session's Ray, with this module's functions sent by value (workers cannot import test modules)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_local


def test_a_phase_whose_tasks_never_finish_stops_with_an_error_naming_it(ray_here):
    executor = RayExecutor(progress=False, stall_timeout_s=1)
    start = time.monotonic()
    # two tasks that sleep an hour, far past the 1 s watchdog
    with pytest.raises(PhaseStalled, match=r"^hang forever: no task has finished for 1 s \(ray.stall_timeout_s\)") as info:
        executor.run_tasks(nap, None, [(3600,), (3601,)], "hang forever")
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "2 of 2 tasks are unfinished, among them nap(3600)" in message and "; nap(3601)" in message
    assert "rerunning the same command resumes" in message
    # this session's logs, not /tmp/ray/session_latest (the newest session on the machine: another Ray's)
    assert f"raylet.out, runtime_env_agent.log in {ray_here._private.worker._global_node.get_logs_dir_path()})" in message
    # the stalled tasks were cancelled: the shared Ray's two CPUs are free for the next test (else this stalls)
    assert RayExecutor(progress=False, stall_timeout_s=60).run_tasks(nap, None, [(0,), (0,)], "after") == [None, None]


def test_a_task_function_is_sent_to_the_cluster_once_not_once_a_phase(ray_local, tmp_path, slice_input):
    """Ray stores a function in its cluster (and each worker loads it) for every Ray function made from a Python
    one: the executor makes one a task function, so a second run, whose phases run the same tasks, sends none."""
    from ray._private.worker import global_worker

    from datapipe import curate

    def sent() -> int:
        return len(global_worker.gcs_client.internal_kv_keys(b"RemoteFunction:", b"fun"))

    for out in ("first", "second"):
        before = sent()
        curate(small_config(tmp_path / out, [slice_input]), executor=RayExecutor(progress=False, stall_timeout_s=STALL_S),
               progress=False, log=lambda _: None)
    assert sent() == before and before > 0


def test_the_stall_stop_does_not_wait_on_a_dead_cluster_that_ray_remembers(ray_here, tmp_path, monkeypatch):
    # A `ray start` leaves its address in <temp dir>/ray/ray_current_cluster; here one of a cluster that is
    # gone. Ray's state API given no address looked the dashboard up there, 20 times 2 s apart.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    executor = RayExecutor(progress=False, stall_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(PhaseStalled, match=r"^dead cluster: no task has finished for 1 s"):
        executor.run_tasks(nap, None, [(3600,), (3601,)], "dead cluster")
    assert time.monotonic() - start < 1 + 10  # it took 1 + 40 s and more


class _TaskRef:
    def __init__(self, hex_id: str) -> None:
        self.hex_id = hex_id

    def task_id(self):
        return type("TaskID", (), {"hex": lambda _: self.hex_id})()


def test_the_task_state_query_goes_to_the_running_clusters_dashboard_or_nowhere(monkeypatch):
    from ray.experimental import internal_kv
    from ray.util import state

    dashboard = [b"10.1.2.3:8265"]  # what the running cluster's GCS says (None: it has no dashboard)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, namespace=None: dashboard[0])
    assert executors.state_api_url(None, {}) == "http://10.1.2.3:8265"
    # RAY_ADDRESS overrides the address the state API is given: used only when it is the one connected to
    assert executors.state_api_url("10.1.2.3:6379", {"RAY_ADDRESS": "10.1.2.3:6379"}) == "http://10.1.2.3:8265"
    assert executors.state_api_url("10.1.2.3:6379", {"RAY_ADDRESS": "10.9.9.9:6379"}) is None
    assert executors.state_api_url(None, {"RAY_ADDRESS": "10.9.9.9:6379"}) is None
    assert executors.state_api_url(None, {"RAY_API_SERVER_ADDRESS": "http://10.9.9.9:8265"}) is None

    asked = []
    monkeypatch.setattr(state, "list_tasks", lambda address, **kw: asked.append(address) or [])
    executor = object.__new__(RayExecutor)  # no Ray started: `_stalled` alone
    executor.ray, executor.stall_timeout_s, executor._connected_with = _InstantRay(), 1, None
    waiting = [(_TaskRef(f"{i:02x}"), f"nap({i})") for i in range(3)]
    assert "among them nap(0); nap(1); nap(2)." in str(executor._stalled("hang", waiting, 3, 3))
    assert asked == ["http://10.1.2.3:8265"]  # the running cluster's, and once: no state for the first, so no more
    dashboard[0] = None
    asked.clear()
    executor._stalled("hang", waiting, 3, 3)
    assert asked == []  # no dashboard: no query


def test_the_watchdog_counts_from_the_last_finished_task_not_from_the_start(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(_ray_executor.time, "monotonic", lambda: now[0])
    watch = _ray_executor._StallWatch(10)
    for t in range(1, 40):  # a long phase that finishes a task every 9 s is never a stall
        now[0] = 9.0 * t
        assert not watch.stalled()
        watch.finished(1)
    now[0] += 9.0
    watch.finished(0)  # a look that found nothing finished does not reset the clock
    now[0] += 1.5
    assert watch.stalled()
    assert not _ray_executor._StallWatch(0).stalled()  # 0 = off


class _InstantRay:
    """Just enough of Ray for `RayExecutor._gather`: every task is done when looked at; records each look's size."""

    class exceptions:
        RayTaskError = type("RayTaskError", (Exception,), {})

    def __init__(self) -> None:
        self.looks: list[int] = []

    def wait(self, refs, num_returns, timeout, fetch_local=True):
        self.looks.append(len(refs))
        return list(refs), []

    def get(self, refs):
        return list(refs)


def test_each_look_at_a_big_phase_covers_a_bounded_window():
    executor = object.__new__(RayExecutor)  # no Ray started: `_gather` alone, over a fake
    executor.ray, executor.stall_timeout_s, executor.progress = _InstantRay(), 600, False
    refs = list(range(5000))
    assert executor._gather(refs, "big", "task", [(i,) for i in refs]) == refs
    # ray.wait is given at most _WAIT_WINDOW refs at a time (it was every pending ref, once per 16 results)
    assert executor.ray.looks == [_ray_executor._WAIT_WINDOW] * 4 + [5000 - 4 * _ray_executor._WAIT_WINDOW]


def test_an_embedded_ray_starts_without_its_idle_head_processes_and_only_during_its_init():
    from ray._private.node import Node

    originals = (Node.start_monitor, Node.start_api_server)
    with _embedded._without_idle_head_processes():
        assert Node.start_monitor(object()) is None and Node.start_api_server(object(), include_dashboard=False) is None
        assert (Node.start_monitor, Node.start_api_server) != originals
    assert (Node.start_monitor, Node.start_api_server) == originals  # a Ray this process starts later is Ray's as usual


def test_an_embedded_ray_starts_with_its_metrics_off_and_the_driver_keeps_its_environment(monkeypatch):
    import ray

    seen = {}
    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))  # what the processes it starts inherit
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    RayExecutor(progress=False).shutdown()
    assert seen["RAY_enable_metrics_collection"] == "0" and seen["TOKENIZERS_PARALLELISM"] == "false"
    assert "RAY_enable_metrics_collection" not in os.environ


def test_an_embedded_ray_shipping_modules_starts_no_workers_ahead_that_no_task_would_use(monkeypatch, tmp_path):
    """Ray starts two workers ahead for its first driver, without a runtime_env; a run that ships its stages' modules
    runs every task in workers started with them, so those two would start for nothing."""
    import ray

    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append(kwargs))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    (tmp_path / "my_stage.py").write_text("")
    RayExecutor(progress=False).shutdown()
    RayExecutor(progress=False, py_modules=[str(tmp_path / "my_stage.py")]).shutdown()
    assert "_system_config" not in seen[0] and "runtime_env" not in seen[0]
    assert seen[1]["_system_config"] == {"prestart_worker_first_driver": False}
    assert seen[1]["runtime_env"] == {"py_modules": [str(tmp_path / "my_stage.py")]}


# ------------------------------------------------------------------------------ an embedded Ray dies with its driver

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


@linux_only
def test_the_raylet_children_launcher_runs_the_script_as_python_would_and_dies_with_its_parent(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import ctypes, signal, sys\n"
                      "death = ctypes.c_int()\n"
                      "ctypes.CDLL(None).prctl(2, ctypes.byref(death))\n"  # PR_GET_PDEATHSIG
                      "print(__name__, sys.argv, sys.path[0], death.value == signal.SIGKILL)\n")
    launched = [sys.executable, "-u", "-c", _embedded._DIE_WITH_THE_RAYLET, str(script), "a", "--b"]
    out = subprocess.run(launched, capture_output=True, text=True, env={**os.environ, "RAY_RAYLET_PID": str(os.getpid())})
    assert out.stdout.split("\n")[0] == f"__main__ {[str(script), 'a', '--b']} {tmp_path} True", out.stderr
    # started after its raylet died (its parent is not the raylet): it exits instead of running unwatched
    orphan = subprocess.run(launched, capture_output=True, text=True, env={**os.environ, "RAY_RAYLET_PID": "1"})
    assert orphan.returncode == 1 and orphan.stdout == ""


def test_the_raylet_children_launcher_is_in_place_only_during_an_embedded_init():
    from ray._private import services

    originals = (services._build_python_executable_command_memory_profileable, services._site_flags)
    with _embedded._dying_with_the_raylet():
        if sys.platform.startswith("linux"):
            agent = services._build_python_executable_command_memory_profileable("dashboard_agent", "/tmp")
            assert agent[:2] == [sys.executable, "-u"] and agent[2:] == ["-c", _embedded._DIE_WITH_THE_RAYLET]
            assert services._site_flags()[-2:] == ["-c", _embedded._DIE_WITH_THE_RAYLET]
    assert (services._build_python_executable_command_memory_profileable, services._site_flags) == originals


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # a zombie is dead, not yet reaped
    except psutil.NoSuchProcess:
        return False


def _cluster_once_started(driver: subprocess.Popen, deadline: float) -> list:
    """[(process, command line)] of the driver's descendants, once they include Ray's two agents and a worker."""
    import psutil

    processes: dict = {}  # pid -> the process as first seen (its is_running() tells a reused pid)
    names: dict = {}  # pid -> its command line now: Ray renames its agents and workers `ray::...` once started
    while time.monotonic() < deadline and driver.poll() is None:
        for process in psutil.Process(driver.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # gone meanwhile
                names[process.pid] = " ".join(process.cmdline()).strip()[:120]
                processes.setdefault(process.pid, process)
        agents = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} & set(names.values())
        if len(agents) == 2 and any(n.startswith("ray::") and n not in agents for n in names.values()):
            return [(processes[pid], name) for pid, name in names.items()]
        time.sleep(0.05)
    raise AssertionError(f"Ray's agents and a worker did not start: {sorted(names.values())}")


def _listening(processes: list) -> list[tuple[str, str]]:
    """(command line, address) of every TCP socket the processes listen on."""
    import psutil

    found = []
    for process, name in processes:
        with contextlib.suppress(psutil.Error):
            found += [(name, c.laddr.ip) for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    return found


@linux_only
def test_an_embedded_ray_listens_on_loopback_only_and_a_killed_driver_leaves_no_process_of_it(tmp_path):
    """`datapipe curate` on its embedded Ray: every server of that Ray (GCS, raylet, agents, workers) and the driver
    listen on 127.0.0.1 only and its token file is the owner's alone (0600); killed with SIGKILL, every process of
    it is gone seconds later. (Ray's agents used to wait 60 s for the dead GCS, a starting worker ~25 s.)"""
    pytest.importorskip("ray")
    import psutil  # Ray's own copy (ray/thirdparty_files), importable once Ray is

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"inputs: [{{path: '{ASSETS / 'corpus_slice.jsonl'}', domain_field: source}}]\n"
                   "read: {block_bytes: 2048, batch_size: 4}\nfilters: {code: {code: {}}}\n"
                   "tokenizer: {train: {vocab_size: 600}}\noutput: {shard_bytes: 4096}\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded Ray, never a cluster
    driver = subprocess.Popen([sys.executable, "-m", "datapipe", "curate", str(cfg), "--output", str(tmp_path / "out"),
                               "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    cluster: list = []
    try:
        cluster = _cluster_once_started(driver, time.monotonic() + 120)
        sockets = _listening([(psutil.Process(driver.pid), "driver"), *cluster])
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 15
    while (alive := [(p, name) for p, name in cluster if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process, _ in alive:  # not left running after a failure
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    assert not alive, f"alive 15 s after the driver was killed: {[name for _, name in alive]}"
    assert len(sockets) >= 4 and all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in sockets), sockets
    assert (Path.home() / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600


def test_without_rays_private_internals_an_embedded_init_is_left_as_ray_makes_it(monkeypatch):
    """Ray is pinned to the versions CI runs; on another whose internals lack these names, both patches step
    aside: nothing is replaced and nothing raises (Ray starts its monitor, dashboard head and agents as usual)."""
    import types

    import ray._private

    monkeypatch.setitem(sys.modules, "ray._private.node", types.ModuleType("ray._private.node"))  # no Node
    monkeypatch.setattr(ray._private, "services", types.ModuleType("ray._private.services"))  # no launchers
    with _embedded._without_idle_head_processes(), _embedded._dying_with_the_raylet():
        assert not hasattr(sys.modules["ray._private.node"], "Node")
        assert not hasattr(ray._private.services, "_site_flags")
