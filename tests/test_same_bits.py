"""The same input gives the same bits whatever BLAS does: a selection model's fit, a prioritized loader's plan and
diversity's k-means (its centroids, its distances, its clusters), each computed in a child process with 1 and 2
OpenBLAS threads and with other OpenBLAS kernels (Haswell's, Sandy Bridge's)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CHILD = f"""
import hashlib, json, sys, tempfile
sys.path.append({str(TESTS)!r})
from helpers import ASSETS, mixed_shards, write_source
from datapipe.loader import PackedLoader
from stages import diversity
from stages.diversity_kernels import squared_distances
from stages.selection._classifier import QualityClassifier

docs = [json.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_text().splitlines()]
fit = QualityClassifier.fit([d["text"] for d in docs if d["source"] == "code"],
                            [d["text"] for d in docs if d["source"] != "code"])
out = tempfile.mkdtemp()
write_source(out, mixed_shards(seed=3, n_shards=6, per_shard=40, high=300), scores=True)
plan = hashlib.sha256()
loader = PackedLoader(out, seq_len=64, batch_size=2, epochs=1, prioritize=True)
for i, batch in enumerate(loader):
    if i >= 150:
        break
    for key in sorted(batch):
        plan.update(batch[key].numpy().tobytes())
    plan.update(json.dumps(loader.state_dict()["planner"], sort_keys=True).encode())
    ids = batch["doc_ids"]
    loader.report_losses(ids, (ids % 13).float() / 13 + 1)
import numpy as np
# 2,000 hashed n-gram bags against 100 centroids between pairs of them: near ties, which BLAS's float32 GEMM (the
# code before the compiled distances) broke one way with one kernel and the other way with another
rng = np.random.default_rng(0)
x = diversity.features([rng.integers(0, 30000, size=rng.integers(50, 1500)) for _ in range(2000)], 1024)
between = x[:100] * 0.5 + x[100:200] * 0.5
centroids = diversity.kmeans(x[:500], 8, 25, 0)
kmeans = hashlib.sha256(diversity.assign_clusters(x, between).tobytes() + centroids.tobytes()
                        + squared_distances(x, centroids).tobytes()).hexdigest()
print(json.dumps({{"fit": hashlib.sha256(fit.to_bytes()).hexdigest(), "plan": plan.hexdigest(), "kmeans": kmeans}}))
"""


def _digests(**env: str) -> dict[str, str]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "OMP_", "MKL_"))}
    done = subprocess.run([sys.executable, "-c", CHILD], env={**child_env, **env}, capture_output=True, text=True,
                          timeout=120, cwd=TESTS.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="OpenBLAS's Haswell kernel is an x86-64 one")
def test_a_fit_a_prioritized_plan_and_k_means_are_the_same_bits_on_any_blas_kernel_and_thread_count():
    one = _digests(OPENBLAS_NUM_THREADS="1")
    assert _digests(OPENBLAS_NUM_THREADS="2") == one
    assert _digests(OPENBLAS_NUM_THREADS="2", OPENBLAS_CORETYPE="Haswell") == one
    assert _digests(OPENBLAS_NUM_THREADS="1", OPENBLAS_CORETYPE="Sandybridge") == one
