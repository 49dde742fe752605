"""`RayExecutor`: tasks on Ray (an embedded local instance or a cluster), the one module that submits them.

Task submission with the workers' environment and memory declaration, gathering with the stall watch
(`PhaseStalled`), worker-death filtering (`WorkerDeathFilter`), the state query a stall error quotes, and
where to run (`ray_address`, `ray_is_running`). Ray is imported here only, inside functions: importing this
module does not import Ray.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import re
import reprlib
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from datapipe.core.config import ConfigError, RunStopped
from datapipe.core.storage import storage_env
from datapipe.curation.executors._embedded import (
    _EMBEDDED_RAY_ENV,
    _RAY_AUTH_LOGGER,
    _DropTokenAuthNotice,
    _dying_with_the_raylet,
    _environment,
    _on_loopback_only,
    _private_token_file,
    _without_idle_head_processes,
)
from datapipe.curation.executors._progress import _bar


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


@functools.cache
def _remote_function(ray: Any, fn: Callable[..., Any]) -> Any:
    """Ray's function of a task function (one for each): Ray sends a function to the cluster, and each worker loads it,
    once per function it makes, so one made per phase would be sent and loaded again by every phase of every run. Ray
    sends it again by itself after a restart (another cluster or job)."""
    return ray.remote(fn)


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


def _unpicklable(shared: Any, desc: str) -> ConfigError:
    """Why what a phase's tasks share cannot go to Ray's workers: the part that does not pickle, named from the
    innermost object on the way down that has a string `name` (a stage), e.g. "stage 'locked' (my_filters.Locked)
    holds .lock, a _thread.lock"."""
    from ray import cloudpickle

    way, error = _way_to_unpicklable(shared, cloudpickle.dumps)
    named = [i for i, (_, part) in enumerate(way) if isinstance(getattr(part, "name", None), str)]
    holder = f"stage {way[named[-1]][1].name!r} ({_type_name(way[named[-1]][1])})" if named else "what they share"
    attribute = "".join(step for step, _ in way[named[-1] + 1 if named else 0:])
    what = f"{holder} holds {attribute}, a {_type_name(way[-1][1])}," if attribute else holder
    return ConfigError(
        f"{desc}: its tasks cannot be sent to Ray's workers: {what} which cannot be pickled ({error}). Every stage "
        "is pickled to reach the workers: make such an object where it is used (once per process, in check or "
        "__call__), or leave it out in __getstate__ and make it again in __setstate__; --executor local runs "
        "without pickling.")


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _way_to_unpicklable(obj: Any, dumps: Callable[[Any], bytes]) -> tuple[list[tuple[str, Any]], str]:
    """From `obj`, which does not pickle, down to its innermost part that does not: the steps ('.lock', '[2]') with
    the part each leads to, and that part's pickling error."""
    try:
        dumps(obj)
        return [], "it pickles here"
    except Exception as exc:  # noqa: BLE001 - any pickling failure is what is looked for
        error = f"{type(exc).__name__}: {exc}"
    way: list[tuple[str, Any]] = []
    seen = {id(obj)}
    while len(way) < 32:
        if isinstance(obj, (list, tuple)):
            children = [(f"[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, dict):
            children = [(f"[{k!r}]", v) for k, v in obj.items()]
        else:
            children = [(f".{k}", v) for k, v in getattr(obj, "__dict__", {}).items()]
        for step, child in children:
            if id(child) in seen:
                continue
            try:
                dumps(child)
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
                break
        else:
            break  # no part of `obj` fails alone: `obj` is the culprit
        seen.add(id(child))
        way.append((step, child))
        obj = child
    return way, error.splitlines()[0][:200]


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
                    with _environment({**_WORKER_ENV, **_EMBEDDED_RAY_ENV}), _without_idle_head_processes(), \
                            _dying_with_the_raylet(), _on_loopback_only():
                        # The two workers Ray starts ahead for its first driver have no runtime_env: with the
                        # stages' modules shipped, every task runs in workers Ray starts for those, so not them.
                        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                                 **({"runtime_env": shipped, "_system_config": {"prestart_worker_first_driver": False}}
                                    if shipped else {}), **kwargs)
                finally:
                    auth_log.removeFilter(notice)
                    _private_token_file()
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
        remote = _remote_function(self.ray, fn).options(num_cpus=1, max_retries=self.max_retries, **self._task_env,
                                                        **self._memory(memory))
        try:
            shared_ref = self.ray.put(shared)
        except (TypeError, pickle.PicklingError):  # Ray's error quotes the whole plan's repr and names no stage
            raise _unpicklable(shared, desc) from None
        refs = [remote.remote(shared_ref, *item) for item in items]
        return self._gather(refs, desc, getattr(fn, "__name__", "task"), items)

    def shutdown(self) -> None:
        if self._owns_ray:
            self.ray.shutdown()
        self._unfilter()
