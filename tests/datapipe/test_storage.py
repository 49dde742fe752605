"""datapipe.core.storage against a real S3 API server (moto's, a separate process), and the URL errors:
an output URL that cannot be written is a ConfigError before any work, never a local folder named `s3:`."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from helpers import ASSETS, small_config
from datapipe.core.config import ConfigError
from datapipe.core.shards import (
    atomic_write_json, atomic_write_table, read_table, remove_temporaries, replacing, write_shard,
)
from datapipe.core.storage import RemotePath, absolute, check_url, location, remove_tree, storage_env


@pytest.fixture
def s3_folder(s3_server) -> str:
    """A fresh prefix of the test bucket."""
    return f"s3://{s3_server[1]}/{uuid.uuid4().hex[:12]}"


def test_local_paths_stay_plain_paths(tmp_path):
    assert location(str(tmp_path)) == tmp_path and type(location(str(tmp_path))) is type(tmp_path)
    assert location(f"file://{tmp_path}") == tmp_path
    assert absolute("out/run") == str(Path.cwd() / "out/run")
    assert absolute("s3://bucket/run/") == "s3://bucket/run"  # a URL is never made a local path
    assert storage_env({"AWS_ENDPOINT_URL": "x", "FSSPEC_S3_KEY": "k", "HOME": "/h"}) == \
        {"AWS_ENDPOINT_URL": "x", "FSSPEC_S3_KEY": "k"}


def test_remote_path_writes_reads_lists_and_deletes(s3_folder):
    out = location(s3_folder)
    assert isinstance(out, RemotePath) and not out.exists()
    table = pa.table({"x": [1, 2, 3]})
    atomic_write_table(out / "work" / "a" / "b.arrow", table)
    atomic_write_json(out / "work" / "a" / "c.json", {"k": 1})
    assert read_table(f"{s3_folder}/work/a/b.arrow") == table
    assert (out / "work" / "a" / "c.json").read_text() == '{\n "k": 1\n}\n'
    assert [p.name for p in (out / "work" / "a").glob("*.arrow")] == ["b.arrow"]
    assert [p.name for p in (out / "work").iterdir()] == ["a"] and (out / "work").is_dir()
    assert (out / "work" / "a" / "b.arrow").is_file() and not (out / "work" / "a").is_file()
    # Tasks get it pickled: it reopens its file system where it lands.
    assert pickle.loads(pickle.dumps(out / "work")) == out / "work"
    assert (out / "work").parent == out and (out / "work").name == "work"
    remove_tree(out / "work")
    assert not (out / "work").exists()


def test_a_failed_remote_write_leaves_no_object(s3_folder):
    """The object appears under its name only when complete: a write that fails half-way leaves neither it
    nor its temporary, and a temporary a killed writer left is removed by remove_temporaries."""
    out = location(s3_folder)
    target = out / "stats.json"
    with pytest.raises(RuntimeError):
        with replacing(target, durable=True) as tmp, tmp.open("wb") as f:
            f.write(b'{"half": ')
            raise RuntimeError("killed")
    assert not target.exists() and list(out.glob("*")) == []
    left = out / "work" / ".u000001.json.tmp-123-0123abcd"  # as a killed process leaves it
    with left.open("wb") as f:
        f.write(b"{")
    atomic_write_json(out / "work" / "u000002.json", {})
    assert remove_temporaries(s3_folder) == [left]
    assert [p.name for p in (out / "work").glob("*")] == ["u000002.json"]


def test_a_remote_shard_describes_the_bytes_written(s3_folder, tmp_path):
    table = pa.table({"id": ["a", "b"], "domain": ["d", "d"], "tokens": pa.array([[1, 2], [3]], pa.list_(pa.uint16())),
                      "num_tokens": pa.array([2, 1], pa.int64()), "lang": pa.nulls(2, pa.string())})
    remote, local = write_shard(s3_folder, 0, table), write_shard(tmp_path, 0, table)
    assert remote == local  # same bytes, same checksum and size as the local file's
    assert read_table(f"{s3_folder}/{remote.path}") == table


@pytest.mark.parametrize("url, says", [
    ("foo://bucket/run", "names a file system datapipe cannot use"),
    ("http://127.0.0.1:1/run", "read-only file system"),
    ("memory://run", "in-memory file system"),
])
def test_an_output_url_that_cannot_be_written_is_a_config_error(tmp_path, slice_input, url, says):
    with pytest.raises(ConfigError, match="output.dir") as error:
        small_config(tmp_path / "unused", [slice_input], output={"dir": url})
    assert url in str(error.value) and says in str(error.value)
    check_url("s3://bucket/run", "output.dir")  # installed and writable: no error


def test_the_cli_refuses_an_unusable_output_url_before_any_work(tmp_path):
    """The issue's report: `--output SCHEME://…` wrote into a local folder `SCHEME:/…` and exited 0."""
    cmd = [sys.executable, "-m", "datapipe", "curate", str(Path("configs/quickstart.yaml").resolve()), "--no-progress",
           "--executor", "local", "--input", str(ASSETS / "corpus_slice.jsonl"), "--output", "foo://bucket/run"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "output.dir" in done.stderr and "foo://bucket/run" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no folder named foo:


def test_storage_that_cannot_be_reached_is_a_config_error_naming_the_url(s3_folder, monkeypatch, tmp_path, slice_input):
    """No credentials: one clear paragraph before any work, not botocore's traceback from deep in a task."""
    import s3fs

    from datapipe.curation.executors import LocalExecutor
    from datapipe import curate
    from datapipe.inspect import stats

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # a cached file system would keep the credentials it was made with
    try:
        with pytest.raises(ConfigError, match=f"OUTPUT_DIR: cannot reach {s3_folder} .*NoCredentialsError.*AWS_ACCESS_KEY_ID"):
            stats.collect(s3_folder)
        with pytest.raises(ConfigError, match=f"output.dir: cannot reach {s3_folder}/run"):
            curate(small_config(f"{s3_folder}/run", [slice_input]), executor=LocalExecutor(), progress=False)
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match="names a file system datapipe cannot use"):
        stats.collect("foo://bucket/run")


def _without_credentials(tmp_path: Path) -> dict[str, str]:
    """This environment with the S3 endpoint but no credentials anywhere botocore looks."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                             "AWS_SESSION_TOKEN", "AWS_PROFILE")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    return env


@pytest.mark.parametrize("key, args", [
    ("inputs[0].path", ["--input", "{s3}/in/docs.jsonl"]),
    ("inputs[0].path", ["--input", "{s3}/in/*.jsonl"]),
    ("tokenizer.path", ["--input", "{slice}", "--set", "tokenizer.path={s3}/tok/tokenizer.json"]),
    ("eval.source", ["--input", "{slice}", "--set", "eval.source={s3}/other/eval"]),
])
def test_an_input_url_that_cannot_be_reached_is_one_paragraph(s3_folder, tmp_path, key, args):
    """The issue's report: an s3:// input without credentials was botocore's 68-line traceback from the reader.
    Every URL a curation reads is checked before any work, like the output (one request each)."""
    import s3fs

    s3fs.S3FileSystem().put_file(str(ASSETS / "corpus_slice.jsonl"), f"{s3_folder}/in/docs.jsonl")
    args = [a.format(s3=s3_folder, slice=ASSETS / "corpus_slice.jsonl") for a in args]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "datapipe", "curate", str(Path("configs/quickstart.yaml").resolve()), "--no-progress",
           "--executor", "local", "--output", str(tmp_path / "out"), *args]
    done = subprocess.run(cmd, cwd=cwd, env=_without_credentials(tmp_path), capture_output=True, text=True, timeout=120)
    url = next(a.split("=", 1)[-1] for a in args if a.split("=", 1)[-1].startswith("s3://"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"datapipe: error: {key}: cannot reach {url} (NoCredentialsError"), done.stderr
    assert "AWS_ACCESS_KEY_ID" in done.stderr
    assert not (tmp_path / "out").exists() and list(cwd.iterdir()) == []  # before any work


def test_train_data_url_that_cannot_be_reached_is_one_paragraph(s3_folder, tmp_path):
    cmd = [sys.executable, "-m", "datapipe", "train", str(Path("configs/train-tiny.yaml").resolve()),
           "--data", f"{s3_folder}/run", "--output", str(tmp_path / "run")]
    done = subprocess.run(cmd, cwd=tmp_path, env=_without_credentials(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith(f"datapipe: error: data.source: cannot reach {s3_folder}/run (NoCredentialsError")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_an_output_folder_that_cannot_be_made_says_what_is_wrong(tmp_path):
    from datapipe.core.storage import make_local_folder

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"^output.dir: '.*a-file' is a file, not a folder; give a folder"):
        make_local_folder(tmp_path / "a-file", "output.dir")
    with pytest.raises(ConfigError, match=r"^output.dir: cannot create the folder '.*a-file/x/y': '.*a-file' is a file"):
        make_local_folder(tmp_path / "a-file" / "x" / "y", "output.dir")
    if Path("/proc/self").is_dir():  # Linux: no folder can be made there, whoever runs the tests
        with pytest.raises(ConfigError, match=r"^output.dir: cannot create the folder '/proc/none/x': .*; give a folder "
                                              r"you may write to"):
            make_local_folder("/proc/none/x", "output.dir")
    make_local_folder(f"file://{tmp_path}/new/run", "output.dir")
    assert (tmp_path / "new" / "run").is_dir()
    make_local_folder("s3://bucket/run", "output.dir")  # object stores have no folders: nothing to make


def test_train_refuses_an_output_url_and_checks_a_url_data_folder(tmp_path, s3_folder):
    from datapipe.train.config import check_sources, load_train_config

    with pytest.raises(ConfigError, match="train.output.*s3://bucket/run"):
        load_train_config(None, [], data=str(tmp_path), output="s3://bucket/run")
    cfg = load_train_config(None, [], data=s3_folder, output=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=f"data.source must be a curated folder.*{s3_folder}.*does not exist"):
        check_sources(cfg)


def test_other_local_only_outputs_refuse_a_url(capsys):
    from datapipe import cli
    from datapipe.core.config import from_dict
    from datapipe.curation.preferences import PreferenceConfig
    from datapipe.train.experiment import load_experiment_config

    with pytest.raises(ConfigError, match="output must be a local folder.*s3://bucket/prefs"):
        from_dict(PreferenceConfig, {"inputs": ["p.jsonl"], "output": "s3://bucket/prefs"})
    with pytest.raises(ConfigError, match="output must be a local folder.*s3://bucket/exp"):
        load_experiment_config(Path("configs/experiment-tiny.yaml").resolve(), output="s3://bucket/exp")
    assert cli.main(["run", "--output", "s3://bucket/run", "--no-progress"]) == 2  # it trains next to its output
    assert "s3://bucket/run" in capsys.readouterr().err


def test_the_s3_client_keeps_as_many_connections_as_a_receiver_asks_for_at_once():
    pytest.importorskip("s3fs")
    from datapipe.core.storage import S3_CONNECTIONS, RemotePath

    fs = RemotePath("s3://some-bucket/run").fs
    assert fs.config_kwargs["max_pool_connections"] == S3_CONNECTIONS > 10  # botocore's default is 10


def test_a_work_file_on_s3_is_read_in_one_request(s3_server):
    """s3fs asks an object's size (a HEAD) before a whole read, to decide on a chunked download that only objects
    over 50 MiB take: a work file or a task record is read with one GET instead."""
    from datapipe.core.storage import RemotePath
    from datapipe.core.workfiles import read_record, read_work_table, write_record, write_work_table

    _, bucket = s3_server
    base = RemotePath(f"s3://{bucket}/one-request")
    write_work_table(base / "t.arrow", pa.table({"x": [1, 2, 3]}))
    write_record(base / "r.json", {"rows": 3})
    calls = []
    real = base.fs._call_s3

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    base.fs._call_s3 = counting
    try:
        assert read_work_table(base / "t.arrow").column("x").to_pylist() == [1, 2, 3]
        assert read_record(base / "r.json") == {"rows": 3}
    finally:
        del base.fs._call_s3
    assert calls == ["get_object", "get_object"]
