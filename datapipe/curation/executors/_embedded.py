"""The start of an embedded (local) Ray: patches of Ray's private internals, in place only during its `ray.init`.

On 127.0.0.1 only (`_on_loopback_only`), its token file the owner's alone (`_private_token_file`), without the
autoscaler's monitor and the dashboard's head (`_without_idle_head_processes`), with the raylet's
children dying with it (`_dying_with_the_raylet`, `_DIE_WITH_THE_RAYLET`), in the workers' environment
(`_environment`) with Ray's metrics off (`_EMBEDDED_RAY_ENV`), and without Ray's token-authentication notice
(`_DropTokenAuthNotice`). With other internals (another Ray version) each patch steps aside and Ray starts as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, Mapping


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


# Ray's own settings (`RAY_<config name>`) for the processes an embedded `ray.init` starts: no metrics recorded or
# exported, which only a dashboard or a Prometheus scrape would read, and an embedded Ray has neither; without them
# the raylet, the agents and the workers spend less CPU per task (BENCHMARKS.md, the whole quickstart recipe against
# datasketch's near dedup).
_EMBEDDED_RAY_ENV = {"RAY_enable_metrics_collection": "0"}


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


# Ray takes the machine's network address as a node's and binds its servers there, unless it treats the machine as a
# single computer (a laptop): then the node's address is the loopback one. The processes `ray.init` starts read the
# variable; this process has read it into ray_constants at import already.
_LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextlib.contextmanager
def _on_loopback_only() -> Iterator[None]:
    """`ray.init` of an embedded instance whose every server (GCS, raylet, object manager, agents, workers) listens on
    127.0.0.1 only: a run on one machine has nothing to offer another (the token refuses a stranger, but nothing
    needs to be reachable). With other internals (another Ray version) Ray binds as usual."""
    try:
        from ray._private import ray_constants

        before = ray_constants.ENABLE_RAY_CLUSTER
    except (ImportError, AttributeError):
        yield
        return
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with _environment(_LOOPBACK_ONLY_ENV):
            yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _private_token_file() -> None:
    """Ray writes its authentication token (~/.ray/auth_token) readable by every user of the machine (0644): make it
    the owner's alone (0600), as an SSH key is. Left as it is when it is someone else's or is not there."""
    path = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        info = os.stat(path)
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError:
        pass


class _DropTokenAuthNotice(logging.Filter):
    """Ray (2.5x+) turns on token authentication for every new local cluster and logs a warning saying so
    ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out"). For
    the embedded instance, which only this process uses, that is noise: drop that one record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


# The logger of Ray's token-authentication setup (ray/_private/authentication/authentication_token_setup.py).
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
