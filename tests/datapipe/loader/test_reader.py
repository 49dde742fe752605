"""The loader's shard reading (datapipe/loader/reader.py): a missing shard is a ShardError naming it, and
`verify="always"` catches in-place bit rot that the default's (size, mtime) stamp trusts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from datapipe.loader.reader import ShardError
from helpers import write_source

KW = dict(seq_len=64, batch_size=2)


def three_shards(out: Path) -> Path:
    """A source of 3 one-domain shards; returns shard 1's file."""
    write_source(out, [[("a", 40)] * 10, [("a", 50)] * 10, [("a", 60)] * 10])
    return out / shards.read_manifest(out)["shards"][1]["path"]


def read_all(source: Path, **kw) -> int:
    """Builds the loader and serves an epoch; the number of batches."""
    return sum(1 for _ in PackedLoader(source, **KW, **kw))


@pytest.mark.parametrize("verify", [True, "always", False])
def test_a_deleted_shard_is_a_shard_error_naming_it_and_the_fix(tmp_path: Path, verify) -> None:
    path = three_shards(tmp_path)
    path.unlink()
    with pytest.raises(ShardError) as info:  # not a bare FileNotFoundError
        read_all(tmp_path, verify=verify)
    message = str(info.value)
    assert f"shard shards/{path.name} of {tmp_path} is missing" in message
    assert "restore the file, or curate the folder again" in message


def test_bit_rot_with_the_mtime_kept_is_refused_with_verify_always(tmp_path: Path, monkeypatch) -> None:
    path = three_shards(tmp_path)
    assert read_all(tmp_path) > 0  # verified, and remembered by (path, size, mtime)
    before = os.stat(path)
    rotted = bytearray(path.read_bytes())
    rotted[len(rotted) // 2] ^= 0x01  # one bit of the token data, in place
    path.write_bytes(bytes(rotted))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same modification time
    assert os.stat(path).st_size == before.st_size

    hashed: list[str] = []
    real = hashlib.file_digest

    def counting(f, name):
        hashed.append(os.path.basename(getattr(f, "name", "")))
        return real(f, name)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    assert read_all(tmp_path) > 0 and hashed == []  # the default trusts the stamp: the rotted shard is served
    with pytest.raises(ShardError, match=rf"shard shards/{path.name} of .* has sha256 \w+ but the manifest says"):
        read_all(tmp_path, verify="always")
    assert path.name in hashed  # hashed although it passed before


def test_verify_always_hashes_a_shard_on_every_open(tmp_path: Path, monkeypatch) -> None:
    three_shards(tmp_path)
    hashed: list[str] = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: hashed.append(f.name) or real(f, name))
    read_all(tmp_path, verify="always")
    read_all(tmp_path, verify="always")
    assert len(hashed) == 6  # 3 shards, each opened once per loader, hashed each time
    read_all(tmp_path)
    read_all(tmp_path)
    assert len(hashed) == 9  # the default hashes each shard once, then remembers the pass


def test_verify_must_be_true_false_or_always(tmp_path: Path) -> None:
    three_shards(tmp_path)
    with pytest.raises(ConfigError, match=r"verify must be True .*'always' \(hash it on every open\) or False, "
                                          r"got 'sometimes'"):
        PackedLoader(tmp_path, **KW, verify="sometimes")
