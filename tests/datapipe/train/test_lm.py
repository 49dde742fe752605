"""The LM objective's data (datapipe/train/lm.py): `data.verify: always` reaches the loader, so a shard that
rotted in place with its size and modification time kept is refused, not trained on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader.reader import ShardError
from datapipe.train.loop import train
from helpers import tiny_cfg, write_train_source

SETS = ("data.holdout_shards=0", "train.steps=2", "train.eval_every=0", "train.ckpt_every=0")


def test_data_verify_always_refuses_a_shard_that_rotted_in_place(tmp_path: Path) -> None:
    source = write_train_source(tmp_path / "src")
    train(tiny_cfg(source, tmp_path / "first", *SETS))  # the shards it opened pass, and are remembered
    for info in shards.read_manifest(source)["shards"]:
        path = source / info["path"]
        before = os.stat(path)
        rotted = bytearray(path.read_bytes())
        rotted[len(rotted) // 2] ^= 0x01  # one bit, in place: same size
        path.write_bytes(bytes(rotted))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same modification time
    with pytest.raises(ShardError, match=r"shard shards/shard-\d+\.arrow of .* has sha256 \w+ but the manifest says"):
        train(tiny_cfg(source, tmp_path / "second", *SETS, "data.verify=always"))
    with pytest.raises(ConfigError, match=r"data.verify"):
        tiny_cfg(source, tmp_path / "third", *SETS, "data.verify=sometimes")
