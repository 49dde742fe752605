"""Executors: the only module that imports Ray.

`run_tasks(fn, shared, items)` calls `fn(shared, *item)` for every item and returns the results in
item order (state a phase's tasks share, a tokenizer, is cached per worker process by the task itself:
Ray reuses its workers, and starting actor processes cost ~1.5 s a phase). `LocalExecutor` is a plain loop
in this process (unit tests, debugging); `RayExecutor` runs on an embedded local Ray or a cluster,
retrying tasks whose worker process died, and stops a phase in which no task has finished for
`ray.stall_timeout_s` (`PhaseStalled`) instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import reprlib
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

from datapipe.core.config import ConfigError, RunStopped
from datapipe.core.storage import storage_env


class Executor(Protocol):
    num_workers: int

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                  memory: int | None = None) -> list[Any]: ...

    def shutdown(self) -> None: ...


class _PlainProgress:
    """Progress as periodic plain lines, for logs and CI (no carriage returns, no terminal width needed):
    one line when a phase starts, at most one every `every_s` seconds, and one when it ends."""

    def __init__(self, total: int, desc: str, every_s: float = 10.0) -> None:
        self.total, self.desc, self.every_s, self.n = total, desc, every_s, 0
        self.start = self.last = time.monotonic()
        self._say(f"{self.desc}: {total:,} tasks")

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n < self.total and now - self.last >= self.every_s:
            self.last = now
            self._say(f"{self.desc}: {self.n:,}/{self.total:,} tasks, {now - self.start:.0f} s")

    def __enter__(self) -> "_PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self._say(f"{self.desc}: {self.n:,}/{self.total:,} tasks done in {time.monotonic() - self.start:.1f} s")


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar in a terminal; plain periodic lines when stderr is a file, a pipe or a CI log."""
    if not enabled:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=f"{desc:>14}", unit="task", leave=True, dynamic_ncols=True)


class LocalExecutor:
    """Runs everything in this process, in order."""

    num_workers = 1

    def __init__(self, *, progress: bool = False) -> None:
        self.progress = progress

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                  memory: int | None = None) -> list[Any]:
        with _bar(len(items), desc, self.progress) as bar:
            out = []
            for item in items:
                out.append(fn(shared, *item))
                bar.update(1)
            return out

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _user_errors(ray: Any) -> Iterator[None]:
    """Re-raise a user error (a ConfigError: a bad input, a full or read-only disk) that a task
    raised as itself, so the CLI prints its one-paragraph message instead of Ray's wrapper with the
    worker's traceback; any other failure stays as Ray reports it (a bug needs its traceback)."""
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (ConfigError, RunStopped)):  # RunStopped: a damaged work file, named by its reader
            raise cause from None
        raise


# Each Ray worker gets one core; keep native thread pools from oversubscribing it.
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with `values` set, as it was again afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _without_idle_head_processes() -> Iterator[None]:
    """`ray.init` of an embedded instance without two head processes that serve it nothing:
    - the autoscaler's monitor (`ray start --no-monitor` skips it; `ray.init` has no such argument): it adds
      nodes to a cluster, an embedded instance has none to add, and it outlives SIGTERM, so Ray's shutdown
      spent most of its time waiting to kill it;
    - the dashboard's head, which with `include_dashboard=False` loads only Ray's usage-statistics module
      (not the state API), and costs CPU while the run starts (BENCHMARKS.md, "The shipped recipe on the
      shared corpus: 1 and 2 workers", has the figures).
    Ray has no public hook for this: with other internals (another Ray version) they start as usual."""
    try:
        from ray._private.node import Node

        originals = {name: getattr(Node, name) for name in ("start_monitor", "start_api_server")}
    except (ImportError, AttributeError):
        yield
        return
    for name in originals:
        setattr(Node, name, lambda self, *args, **kwargs: None)
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(Node, name, method)


# `python [FLAGS] -c _DIE_WITH_THE_RAYLET SCRIPT ARGS...` runs SCRIPT as `python [FLAGS] SCRIPT ARGS` would, in a
# process that the kernel kills when its parent, the raylet, dies (PR_SET_PDEATHSIG, prctl option 1: the
# fate-sharing Ray gives the processes the driver starts itself); one whose raylet died already exits.
_DIE_WITH_THE_RAYLET = "; ".join([
    "import ctypes, os, runpy, signal, sys",
    "ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGKILL))",
    "os.getppid() == int(os.environ.get('RAY_RAYLET_PID', os.getppid())) or sys.exit(1)",
    "sys.argv.pop(0)",
    # `python -c` imports from the working folder first (''), `python SCRIPT` from SCRIPT's folder
    "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.path[0] == '' else sys.path[0]",
    "runpy.run_path(sys.argv[0], run_name='__main__')",
])


@contextlib.contextmanager
def _dying_with_the_raylet() -> Iterator[None]:
    """`ray.init` of an embedded instance whose raylet's children, its agents (DashboardAgent, RuntimeEnvAgent)
    and its workers, die with it. A killed driver (kill -9, the OOM killer) takes its GCS and raylet with it
    (Ray's fate-sharing), but not their children: the agents saw the raylet die, then waited 60 s to report
    it to the dead GCS; a worker that was starting waited ~25 s for it. The agents cannot be left out (the
    raylet requires them, include_dashboard=False or not) and no Ray setting shortens this, so their command
    and the workers' run through `_DIE_WITH_THE_RAYLET`: the agents' after Ray's interpreter command, the
    workers' among the interpreter flags that Ray's worker launcher (setup_worker.py) passes on to the worker.
    Linux only (prctl); with other internals (another Ray version) they start as usual."""
    try:
        from ray._private import services

        interpreter, site_flags = services._build_python_executable_command_memory_profileable, services._site_flags
    except (ImportError, AttributeError):
        yield
        return
    if not sys.platform.startswith("linux"):
        yield
        return
    services._build_python_executable_command_memory_profileable = (
        lambda *args, **kwargs: [*interpreter(*args, **kwargs), "-c", _DIE_WITH_THE_RAYLET])
    services._site_flags = lambda: [*site_flags(), "-c", _DIE_WITH_THE_RAYLET]
    try:
        yield
    finally:
        services._build_python_executable_command_memory_profileable, services._site_flags = interpreter, site_flags


def worker_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of every task: `_WORKER_ENV` plus the driver's object-storage settings
    (`AWS_*`, `FSSPEC_*`: credentials, endpoint, region), so that workers on nodes that share no folder
    with the driver read and write the same `s3://…` output (`datapipe.core.storage`)."""
    return {**storage_env(environ), **_WORKER_ENV}


class WorkerDeathFilter:
    """Turns a dead worker's fatal-error dump, which Ray forwards to the driver (`log_to_driver`), into
    one line: "tokenize: a Ray worker (pid 123) died (SIGABRT); Ray retries its work ...".

    A worker process that dies of a signal prints a native stack dump (Ray's `*** SIGABRT received`,
    Python's `Fatal Python error`, the extension module list) and the raylet adds "A worker died or
    was killed..." and "Task ... will be retried": dozens of lines, for a failure the run recovers
    from (the task is retried; the output is identical). The dump stays in the
    worker's log file in Ray's session folder. Every other worker line (a stage's warnings) passes
    through unchanged. `handler` is Ray's printer of a batch of forwarded lines; `say` prints our line;
    `phase` names the running phase (read when a worker dies)."""

    _FATAL = re.compile(r"\*\*\* (SIG[A-Z]+) received|RAW: Check .* failed: (.*)|Check failed: (.*)|Fatal Python error: (.*)")
    _RAYLET_DIED = re.compile(r"A worker died or was killed while executing.*?Worker PID: (\d+)")
    _RAYLET_RETRY = re.compile(r"failed\. There are \d+ retries remaining, so the task will be retried|will be restarted")

    def __init__(
        self, handler: Callable[..., None], say: Callable[[str], None], phase: Callable[[], str], wait_s: float = 2.0
    ) -> None:
        self.handler, self.say, self.phase, self.wait_s = handler, say, phase, wait_s
        self.dead: dict[str, str] = {}  # pid -> why: its later lines are the rest of the dump
        self.reported: set[str] = set()
        self._lock = threading.Lock()  # the raylet's messages and the workers' lines come on two threads

    def _died(self, pid: str, why: str, phase: str | None = None) -> None:
        with self._lock:
            if pid in self.reported:
                return
            self.reported.add(pid)
        self.say(f"{phase or self.phase()}: a Ray worker (pid {pid}) died ({why})")

    def _raylet_says_died(self, pid: str) -> None:
        """The raylet's message comes first, the worker's dump (naming the signal) a moment later, or never
        (killed by SIGKILL, the OOM killer): wait `wait_s` for the dump before saying it without the signal."""
        phase = self.phase()
        timer = threading.Timer(self.wait_s, lambda: self._died(pid, self.dead.get(pid) or "it exited unexpectedly", phase))
        timer.daemon = True
        timer.start()

    def __call__(self, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        pid = str(data.get("pid"))
        keep = []
        for line in data.get("lines", []):
            if pid == "raylet":
                if died := self._RAYLET_DIED.search(line):
                    self._raylet_says_died(died.group(1))
                elif not self._RAYLET_RETRY.search(line):
                    keep.append(line)
            elif pid in self.dead:
                continue
            elif fatal := self._FATAL.search(line):
                signal = fatal.group(1)
                self.dead[pid] = signal or next(g for g in fatal.groups() if g).strip()[:120]
                if signal != "SIGTERM":  # SIGTERM: Ray stopping an idle worker at shutdown, not a failure
                    self._died(pid, self.dead[pid])
            else:
                keep.append(line)
        if keep:
            self.handler({**data, "lines": keep}, *args, **kwargs)


def _filter_worker_deaths(say: Callable[[str], None], phase: Callable[[], str]) -> Callable[[], None]:
    """Wrap Ray's printer of forwarded lines (`print_to_stdstream`: the workers' output and the raylet's
    error messages) in `WorkerDeathFilter`, before `ray.init` binds it; returns the undo, for shutdown.
    Ray has no public hook for this: with other internals (another Ray version) the lines stay as Ray
    prints them."""
    try:
        from ray._private import worker as ray_worker

        original = ray_worker.print_to_stdstream
    except (ImportError, AttributeError):
        return lambda: None
    ray_worker.print_to_stdstream = WorkerDeathFilter(original, say, phase)

    def undo() -> None:
        ray_worker.print_to_stdstream = original

    return undo


def ray_address(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where to run: the configured address (`--ray-address`, `ray.address`), else `RAY_ADDRESS` as
    `ray.init()` reads it (set and non-empty), else None: an embedded local Ray."""
    if configured:
        return configured
    return environ.get("RAY_ADDRESS") or None


def ray_is_running() -> bool:
    """Whether this process has joined Ray already (then an executor uses that Ray, whatever its address)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class _DropTokenAuthNotice(logging.Filter):
    """Ray (2.5x+) turns on token authentication for every new local cluster and logs a warning saying so
    ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out"). For
    the embedded instance, which only this process uses, that is noise: drop that one record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


# The logger of Ray's token-authentication setup (ray/_private/authentication/authentication_token_setup.py).
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class PhaseStalled(RunStopped):
    """No task of a phase has finished for `ray.stall_timeout_s` seconds: the message names the phase, the
    tasks it waits for and what to do. The CLI prints it without a traceback and exits 1."""


# How often the driver looks at its running tasks (progress, the stall watchdog), and how many of the
# earliest unfinished tasks one look covers: `ray.wait` costs time in the number of refs it is given, so
# a phase of 100k tasks is watched through a window, not all of them at every look. Ray starts tasks
# in submission order, so the earliest unfinished ones are the ones running.
_POLL_S = 0.5
_WAIT_WINDOW = 1024

# A task's item in an error message: its arguments, each cut short (an item may hold a large plan).
_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 2, 48, 48, 4, 4, 3


def task_label(name: str, item: tuple) -> str:
    """`segment_task(0, 3, 12)`: a task as the stall error names it, its arguments cut short."""
    return f"{name}({', '.join(_SHORT.repr(a) for a in item)})"


def _logs_folder() -> str:
    """The logs of this driver's Ray session (the raylet's, the workers'). /tmp/ray/session_latest names the
    newest session on the machine, which is another instance's when two run at once (two test suites, a
    user's own Ray)."""
    try:
        from ray._private import worker as ray_worker

        return str(ray_worker._global_node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - Ray internals of another version, or a Ray client: the usual place
        return "/tmp/ray/session_latest/logs"


class _StallWatch:
    """Tells when no task of a phase has finished for `timeout_s` seconds (0: never)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()

    def finished(self, n: int) -> None:
        if n:
            self.last = time.monotonic()

    def stalled(self) -> bool:
        return self.timeout_s > 0 and time.monotonic() - self.last > self.timeout_s


def state_api_url(connected_with: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The URL of the state API (served by the dashboard) of the Ray this process is connected to, read from that
    Ray's own GCS; None where it has none (the embedded Ray starts without a dashboard) or where the environment
    would send a query elsewhere: RAY_API_SERVER_ADDRESS and RAY_ADDRESS override any address the state API is
    given, so they are used only when they name the address this executor connected with (`connected_with`).

    Why not `list_tasks()` with no address, or with a GCS address: Ray then looks the dashboard up in the GCS of
    the cluster that RAY_ADDRESS, /tmp/ray/ray_current_cluster (left by a `ray start`, maybe long dead) or the
    one local GCS process names, 20 times 2 s apart while that GCS is down or has no dashboard: a stall stop
    came 40 s late."""
    for name in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        if environ.get(name) and environ[name] != connected_with:
            return None
    try:
        from ray._private import ray_constants
        from ray.experimental import internal_kv

        url = internal_kv._internal_kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    except Exception:  # noqa: BLE001 - Ray internals of another version: no state detail
        return None
    return f"http://{url.decode()}" if url else None


def _task_state(url: str, ref: Any) -> str | None:
    """Ray's state of the task behind `ref` ('PENDING_NODE_ASSIGNMENT', 'RUNNING', ...) from the state API at
    `url`, or None where it does not answer within its timeout."""
    try:
        from ray.util.state import list_tasks

        rows = list_tasks(url, filters=[("task_id", "=", ref.task_id().hex())], timeout=2, raise_on_missing_output=False)
    except Exception:  # noqa: BLE001 - optional detail of an error message, never a second error
        return None
    return f"Ray: {getattr(rows[-1], 'state', '?')}" if rows else None


class RayExecutor:
    """Runs tasks on Ray: an existing cluster (`address`, else `RAY_ADDRESS`) or an embedded local instance."""

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        max_retries: int = 3,
        progress: bool = True,
        stall_timeout_s: float = 600.0,
        py_modules: Sequence[str] = (),
    ) -> None:
        """`py_modules`: files or folders of Python modules Ray ships to the workers (runtime_env py_modules): the
        modules of a recipe's own stages, which a cluster's nodes (or the workers' path) may not hold."""
        import ray

        self.ray = ray
        self.max_retries = max_retries
        self.progress = progress
        self.stall_timeout_s = stall_timeout_s
        self._node_memory: int | None = None  # the largest node's memory resource, read once
        self._owns_ray = False
        self._connected_with: str | None = None  # the address this executor gave `ray.init` (None: embedded, or joined)
        # The workers' environment (`worker_env`), set so that the workers Ray starts with the instance serve
        # every task: an embedded Ray's workers inherit it from the processes `ray.init` starts; a cluster's
        # get it as the job's runtime_env; per task only where this process had joined Ray itself. A runtime_env
        # (a task's or the job's) has Ray start other workers for it: ~1 s before the first task here.
        self._task_env: dict[str, Any] = {}
        shipped = {"py_modules": list(py_modules)} if py_modules else {}  # none: Ray starts no other workers for it
        self.phase = "starting"  # the running phase's name, for the line about a dead worker
        self._unfilter: Callable[[], None] = lambda: None
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=True)
            # A worker that dies mid-run (its task is retried) is one line, not a native stack dump.
            self._unfilter = _filter_worker_deaths(self._say_worker_died, lambda: self.phase)
            address = ray_address(address)
            if address is None:
                # "local" always starts a fresh embedded instance, never a stale cluster from `ray start`
                notice, auth_log = _DropTokenAuthNotice(), logging.getLogger(_RAY_AUTH_LOGGER)
                auth_log.addFilter(notice)
                try:
                    # (the storage settings are in _WORKER_ENV already)
                    with _environment(_WORKER_ENV), _without_idle_head_processes(), _dying_with_the_raylet():
                        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                                 **({"runtime_env": shipped} if shipped else {}), **kwargs)
                finally:
                    auth_log.removeFilter(notice)
            else:
                ray.init(address=address, runtime_env={"env_vars": worker_env(), **shipped}, **kwargs)
                self._connected_with = address
            self._owns_ray = True
        else:
            self._task_env = {"runtime_env": {"env_vars": worker_env(), **shipped}}
        self.num_workers = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def _say_worker_died(self, line: str) -> None:
        then = (f"Ray retries its work (up to ray.max_retries = {self.max_retries} times; the output is the same)"
                if self.max_retries else "ray.max_retries is 0, so the run stops")
        print(f"{line}; {then}. Its log is in Ray's session folder ({_logs_folder()})", file=sys.stderr, flush=True)

    def _gather(self, refs: list[Any], desc: str, name: str, items: Sequence[tuple]) -> list[Any]:
        ray = self.ray
        self.phase = desc
        watch = _StallWatch(self.stall_timeout_s)
        window: list[Any] = []  # the earliest unfinished refs (`_WAIT_WINDOW`); refs[queued:] are not looked at yet
        queued = 0
        with _bar(len(refs), desc, self.progress) as bar, _user_errors(ray):
            while window or queued < len(refs):
                take = min(len(refs), queued + _WAIT_WINDOW - len(window))
                window += refs[queued:take]
                queued = take
                # Returns when the whole window is done or after _POLL_S with those that are: one call per
                # look, however fast results come (not one per handful of results over every pending ref).
                done, window = ray.wait(window, num_returns=len(window), timeout=_POLL_S, fetch_local=False)
                bar.update(len(done))
                watch.finished(len(done))
                if window and watch.stalled():
                    position = {ref: i for i, ref in enumerate(refs)}
                    waiting = [(ref, task_label(name, items[position[ref]])) for ref in window[:3]]
                    error = self._stalled(desc, waiting, len(window) + len(refs) - queued, len(refs))
                    self._cancel(window + refs[queued:])  # after: the error tells Ray's view of them
                    raise error
            return ray.get(refs)

    def _cancel(self, refs: list[Any]) -> None:
        """Stop a stalled phase's tasks (kill those running): on a shared cluster they would hold its CPUs."""
        for ref in refs:
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)

    def _stalled(self, desc: str, waiting: list[tuple[Any, str]], n_waiting: int, total: int) -> PhaseStalled:
        """The stall error: the phase, a few of the tasks it waits for (with Ray's state for them when its
        state API answers quickly), the cluster's free CPUs, and what to do."""
        shown = []
        url = state_api_url(self._connected_with)
        for ref, label in waiting:
            state = _task_state(url, ref) if url else None
            url = url if state else None  # no state for this one: asking again may cost the timeout again
            shown.append(f"{label} ({state})" if state else label)
        cpus = ""
        with contextlib.suppress(Exception):
            free, total_cpus = self.ray.available_resources().get("CPU", 0), self.ray.cluster_resources().get("CPU", 0)
            cpus = f" Ray reports {free:g} of {total_cpus:g} CPUs free."
        return PhaseStalled(
            f"{desc}: no task has finished for {self.stall_timeout_s:g} s (ray.stall_timeout_s), so the run stops "
            f"instead of waiting forever; {n_waiting:,} of {total:,} tasks are unfinished, among them "
            f"{'; '.join(shown)}.{cpus} Finished tasks are kept: rerunning the same command resumes. If Ray's "
            "workers cannot start or keep being killed (a loaded machine, another job filling its memory, a full "
            f"disk), its logs say why (raylet.out, runtime_env_agent.log in {_logs_folder()}); if a task is only "
            "slow (one huge block), raise ray.stall_timeout_s, or set it to 0 to wait without limit."
        )

    def _memory(self, memory: int | None) -> dict[str, int]:
        """Ray's `memory=` for a task that needs about `memory` bytes, at most what the largest node has (a
        task that asks for more than any node has would never be scheduled)."""
        if not memory:
            return {}
        if self._node_memory is None:
            self._node_memory = max((int(n.get("Resources", {}).get("memory", 0)) for n in self.ray.nodes() if n.get("Alive")),
                                    default=0)
        return {"memory": int(min(memory, self._node_memory))} if self._node_memory else {}

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                  memory: int | None = None) -> list[Any]:
        """`memory`: about how many bytes each task needs (Ray then places them so that they fit)."""
        if not items:
            return []
        remote = self.ray.remote(num_cpus=1, max_retries=self.max_retries, **self._task_env, **self._memory(memory))(fn)
        shared_ref = self.ray.put(shared)
        refs = [remote.remote(shared_ref, *item) for item in items]
        return self._gather(refs, desc, getattr(fn, "__name__", "task"), items)

    def shutdown(self) -> None:
        if self._owns_ray:
            self.ray.shutdown()
        self._unfilter()


def make_executor(
    kind: str, address: str | None, *, num_cpus: int | None, max_retries: int, progress: bool, stall_timeout_s: float = 600.0,
    py_modules: Sequence[str] = (),
) -> Executor:
    if kind == "local":
        return LocalExecutor(progress=progress)
    if kind == "ray":
        return RayExecutor(address, num_cpus=num_cpus, max_retries=max_retries, progress=progress,
                           stall_timeout_s=stall_timeout_s, py_modules=py_modules)
    raise ValueError(f"executor must be one of {{'local', 'ray'}}, got {kind!r}")

