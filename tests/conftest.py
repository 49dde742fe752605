"""Shared fixtures: one Ray instance per test session (ray.init costs ~5 s), small configs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

# One thread per process for the pools that read OMP_NUM_THREADS (torch's intra-op pool, OpenBLAS, Arrow's CPU
# pool), set before anything imports them (helpers imports torch): two test processes share the two cores, and
# each one's pool of one thread per core made every torch op of each wait on the other's (the train tests took
# twice the CPU). The CLI children and Ray workers of the tests inherit it, as a run's Ray workers have it anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# helpers (and torch with it) is imported where a fixture needs it: xdist's controller process, which runs no test,
# loads this file too, and the workers start only after it has.
ASSETS = Path(__file__).parent / "assets"


@pytest.fixture(scope="session")
def ray_local():
    """An embedded local Ray with 2 CPUs, shared by every test that needs one. Without the two workers Ray starts
    ahead for its first driver: they would have no runtime_env, and every task of the tests has one (RayExecutor's
    on a Ray it did not start: `worker_env`), so Ray starts its own workers for those anyway. Idle workers are kept (10
    minutes, not Ray's 1 s once more are idle than it has CPUs): the tests' tasks come with a few environments (the S3
    settings or not), and each switch would otherwise kill the idle workers of the other and start them again later."""
    ray = pytest.importorskip("ray")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config={"prestart_worker_first_driver": False,
                                 "idle_worker_killing_time_threshold_ms": 600_000})
    except Exception as exc:  # noqa: BLE001 - a machine where Ray cannot start skips, never fails
        pytest.skip(f"Ray cannot start here: {exc}")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def verified_shard_cache(tmp_path_factory):
    """The loader remembers verified shards under $DATAPIPE_CACHE_DIR: keep the tests' markers out of ~/.cache."""
    os.environ["DATAPIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("datapipe-cache"))


@pytest.fixture
def slice_input() -> dict[str, Any]:
    return {"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}


# The settings that point s3fs (botocore) at the local S3 server of `s3_server`; Ray tasks get them from
# the driver's environment (datapipe.curation.executors.worker_env).
S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 API server on localhost: moto's server mode (`moto_server`, as s3fs tests itself), a separate
    process speaking HTTP. Sets the AWS_* variables that s3fs reads and creates the bucket `datapipe-test`;
    yields (endpoint, bucket). Tests write under their own prefix of the bucket."""
    server = shutil.which("moto_server")
    if server is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    before = {k: os.environ.get(k) for k in S3_ENV}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start on {endpoint} (see {log.name})")
                time.sleep(0.1)
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # an instance made before these settings would keep its endpoint
        s3fs.S3FileSystem().mkdir("datapipe-test")
        yield endpoint, "datapipe-test"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), before any test process starts
        _compile_kernels()


def _compile_kernels() -> None:
    """numba compiles the project's loops (the filters', near dedup's, the tokenizer's split, the loader's) on first
    use and caches them beside their source. In a fresh clone the processes that meet them first (both test
    processes, their Ray workers, CLI children) would wait for each other's compiles (`datapipe.core.compiled`, a lock
    a loop); compiled here once, before any of them starts, they all load them from the cache. In two processes, one
    a core: this one and a fork of it (forked before either imports numba), each compiling about half by their
    compile times in a fresh process (each half also compiles the helpers the filters share)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_compile_loops, args=(1,))
    child.start()
    _compile_loops(0)
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"compiling the numba loops in a forked process failed (exit code {child.exitcode})")


def _compile_loops(half: int) -> None:
    import tempfile

    import numpy as np
    import pyarrow as pa

    from datapipe.core.schema import DOC_SCHEMA
    from stages.base import FilterStage
    from stages.quality import FILTERS, build_filters

    texts = ["The river rose with every storm this spring.\nFarmers say the water reached the fields twice.",
             "def f(x):\n    return x + 1\n# generated by a tool\n", "ΑΣ ΟΔΟΣ\n" * 3]
    batch = pa.RecordBatch.from_pylist([{"id": str(i), "domain": "web", "text": t, "order": i} for i, t in enumerate(texts)],
                                       schema=DOC_SCHEMA)
    second = ("gopher_repetition", "c4")  # about as long as the other filters with the loops of the other modules
    for name in (n for n in FILTERS if (n in second) == bool(half)):  # one at a time: in a chain a filter sees only
        FilterStage(*build_filters({"web": {name: {}}}))(batch)  # what the ones before it kept
    if half == 1:
        return
    from datapipe.loader import PackedLoader
    from datapipe.testing.shards import write_fake_shards
    from stages.fast_bpe import compile_bpe
    from stages.minhash import MinHashConfig, MinHasher, pair_jaccards
    from stages.tokenize import TokenizerConfig, TokenizerTrainConfig, train_tokenizer

    MinHasher(MinHashConfig()).signatures(texts)
    pair_jaccards([np.array([1, 2], np.uint64), np.array([2, 3], np.uint64)], np.array([0]), np.array([1]))

    tokenizer = train_tokenizer(texts * 4, TokenizerConfig(train=TokenizerTrainConfig(vocab_size=300))).to_str()
    compile_bpe(tokenizer).encoder().encode_array(pa.array(texts))  # the split and the table of pieces
    with tempfile.TemporaryDirectory() as folder:  # the loader's two loops, through the loader: a batch of two documents
        write_fake_shards(folder, [[{"id": "a", "domain": "web", "tokens": [1, 2, 3, 0]},
                                    {"id": "b", "domain": "web", "tokens": [4, 5, 0]}]], vocab_size=8)
        next(iter(PackedLoader(folder, seq_len=4, batch_size=2)))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The tests of the two-node cluster run in one test process (`--dist loadgroup`), which starts it once; so do
    the tests on the session's local Ray (`ray_local`, or the `ray_local` mark where a test asks for it by name): one
    Ray and one set of its workers for the suite instead of one in each test process, and a module's Ray fixtures
    built once."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "two_node_cluster" in names:
            item.add_marker(pytest.mark.xdist_group("two_node_cluster"))
        elif "ray_local" in names or item.get_closest_marker("ray_local"):
            item.add_marker(pytest.mark.xdist_group("ray_local"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Cluster(NamedTuple):
    address: str
    env: dict[str, str]  # the environment to run a driver in
    homes: list[Path]  # the head's and the worker node's working folders


@pytest.fixture(scope="session")
def two_node_cluster(tmp_path_factory):
    """`ray start --head` plus a second `ray start --address` on this machine: two raylets, one CPU each, each
    with its own --temp-dir and working folder and started without the object-storage settings (the tasks get
    those from the driver), as nodes that share no folder would be; yields (address, the environment to run a
    driver in) and the nodes' working folders. One for the session (starting it costs ~15 s): each test runs its own
    driver, a job of its own."""
    ray_bin = shutil.which("ray")
    if ray_bin is None:
        pytest.skip("the ray command is not installed")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env.update({"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"})
    temps = [Path("/tmp") / f"ray-dp-{port}-{role}" for role in ("head", "node")]  # socket paths must stay short
    homes = [tmp_path_factory.mktemp("head-node"), tmp_path_factory.mktemp("worker-node")]
    head = subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temps[0]}"],
        cwd=homes[0], env=env, capture_output=True, text=True, timeout=120,
    )
    if head.returncode != 0:
        pytest.skip(f"Ray cannot start a head node here: {head.stderr[-500:]}")
    address = f"127.0.0.1:{port}"
    try:
        worker = subprocess.run(
            [ray_bin, "start", f"--address={address}", "--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temps[1]}"],
            cwd=homes[1], env=env, capture_output=True, text=True, timeout=120,
        )
        if worker.returncode != 0:
            pytest.skip(f"Ray cannot start a second node here: {worker.stderr[-500:]}")
        yield Cluster(address, {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}, homes)
    finally:
        from helpers import stop_cluster

        stop_cluster([str(t) for t in temps] + [f"address={address}"])
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
