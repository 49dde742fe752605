"""Golden outputs: the shards, eval shards and tokenizer of the slice with every curation switch on.

The curation engine is being rebuilt around phases and one exchange; these checksums pin what it wrote
before, so a refactor that changes a byte of training data fails here. Change them only in a commit that
says why the output changed."""

from __future__ import annotations

import hashlib
import json

from datapipe.core.config import from_dict
from datapipe.curation.config import CurateConfig
from datapipe.curation.executors import LocalExecutor
from datapipe import curate
from helpers import ASSETS

EVERY_SWITCH = {
    "read": {"block_bytes": 4096, "batch_size": 8},  # ~12 blocks: every shuffle has several senders
    "dedup": {"exact": {"enabled": True, "partitions": 3}, "minhash": {"enabled": True, "threshold": 0.7, "partitions": 3}},
    "filters": {"code": {"code": {}}, "license": {"gopher_repetition": {}}, "man": {"gopher_repetition": {}}},
    "tokenizer": {"train": {"vocab_size": 500}},
    "eval": {"enabled": True, "fraction": 0.1},
    "diversity": {"enabled": True, "domains": {"man": 0.8}},
    "mixture": {"enabled": True, "method": "temperature", "temperature": 2.0},
    "output": {"shard_bytes": 4096},
}

GOLDEN = {
    "manifest": "fafbab993ffe43a957d8895c95a8032c0f84860a9f1da9698ba139296d264126",
    "eval_manifest": "8851cc25011c6a47085f24bdc6f3587c67290742f22cb33e7d47d9257db8e625",
    "tokenizer": "5c41af49fcb9d04aa2ef2e9bb3e1b0e11bba66538fb93a20e0ff3a89f2a143fa",
}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _without_config(path) -> dict:
    manifest = json.loads(path.read_text())
    for key in ("config", "config_hash"):
        manifest.pop(key)
    return manifest


def golden_digests(out) -> dict[str, str]:
    """The manifests less the config (it names the input's path, which differs per checkout), and the tokenizer."""
    return {
        "manifest": _digest(_without_config(out / "manifest.json")),  # shards' sha256, rows, tokens, mixture, diversity
        "eval_manifest": _digest(_without_config(out / "eval" / "manifest.json")),
        "tokenizer": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
    }


def test_slice_with_every_switch_writes_the_golden_outputs(tmp_path):
    cfg = from_dict(CurateConfig, {"inputs": [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}],
                                   **EVERY_SWITCH, "output": {**EVERY_SWITCH["output"], "dir": str(tmp_path / "out")}})
    curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert golden_digests(tmp_path / "out") == GOLDEN


def test_every_exchange_cut_into_partition_ranges_writes_the_same_golden_outputs(tmp_path, monkeypatch):
    """Where a combine task cannot hold its group's files whole (large keys at scale), the exchange cuts each group
    into partition ranges; forced here at every exchange (a task's budget below one file, two files a receiver),
    the run's outputs are byte for byte the same."""
    from datapipe.core import exchange

    monkeypatch.setattr(exchange, "COMBINE_BYTES", 1)
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)
    cfg = from_dict(CurateConfig, {"inputs": [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}],
                                   **EVERY_SWITCH, "output": {**EVERY_SWITCH["output"], "dir": str(tmp_path / "out"),
                                                              "keep_work": True}})
    curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert golden_digests(tmp_path / "out") == GOLDEN
    ranged = list((tmp_path / "out" / "work").rglob("combined-r*.shuffle"))
    assert len({p.parent for p in ranged}) >= 3  # the ids', exact dedup's and near dedup's keys at least
