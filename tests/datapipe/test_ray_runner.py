"""The runner on Ray: an embedded local instance (shared by the session), a worker process that dies
mid-stage, and a real two-node cluster started with `ray start` on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ASSETS, STALL_S, small_config
from datapipe.curation.executors import LocalExecutor, RayExecutor
from datapipe import curate
from datapipe.core.schema import empty_dropped
from datapipe.core.shards import read_manifest
from stages.base import StageResult


def _run(cfg, executor, **kw):
    return curate(cfg, executor=executor, progress=False, log=lambda _: None, **kw)


def test_ray_gives_the_same_shards_as_one_local_worker(tmp_path, slice_input, ray_local):
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    _run(small_config(local, [slice_input]), LocalExecutor())
    executor = RayExecutor(progress=False, stall_timeout_s=STALL_S)
    assert executor.num_workers == 2
    result = _run(small_config(on_ray, [slice_input]), executor)
    assert read_manifest(on_ray) == read_manifest(local)
    assert result.stats["inputs"][0]["balanced"]


class DieOnce:
    """Kills its worker process the first time it runs (a marker file remembers), like an OOM kill."""

    name = "die_once"

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, batch):
        if not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return StageResult(batch, empty_dropped())


def test_a_worker_that_dies_mid_stage_is_retried(tmp_path, slice_input, ray_local):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
    marker = tmp_path / "died"
    ref, out = tmp_path / "ref", tmp_path / "out"
    _run(small_config(ref, [slice_input]), LocalExecutor())
    _run(small_config(out, [slice_input]), RayExecutor(progress=False, stall_timeout_s=STALL_S), extra_stages=[DieOnce(str(marker))])
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a worker really died
    assert read_manifest(out) == read_manifest(ref)


@pytest.mark.cluster
def test_two_node_cluster_gives_the_same_shards(tmp_path, two_node_cluster):
    address, env, _ = two_node_cluster
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(
        f"inputs: [{{path: '{ASSETS / 'corpus_slice.jsonl'}', domain_field: source}}]\n"
        "read: {block_bytes: 8192}\nfilters: {code: {code: {}}}\n"
        "tokenizer: {train: {vocab_size: 400}}\noutput: {shard_bytes: 8192}\n"
    )
    cmd = [sys.executable, "-m", "datapipe", "curate", str(cfg_file), "--no-progress"]
    local = subprocess.run(cmd + ["--executor", "local", "--output", str(tmp_path / "local")],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    probe = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{address}'); "
         "print(len([n for n in ray.nodes() if n['Alive']]))"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert probe.stdout.strip().splitlines()[-1] == "2", probe.stderr
    cluster = subprocess.run(cmd + ["--ray-address", address, "--output", str(tmp_path / "cluster")],
                             env=env, capture_output=True, text=True, timeout=300)
    assert cluster.returncode == 0, cluster.stderr[-3000:]
    assert read_manifest(tmp_path / "cluster") == read_manifest(tmp_path / "local")
