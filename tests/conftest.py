"""Shared fixtures: one Ray instance per test session (ray.init costs ~5 s), small configs."""

from __future__ import annotations

import os
from typing import Any

import pytest

from helpers import ASSETS


@pytest.fixture(scope="session")
def ray_local():
    """An embedded local Ray with 2 CPUs, shared by every test that needs one."""
    ray = pytest.importorskip("ray")
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
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


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
