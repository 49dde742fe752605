"""Where outputs live: a local folder (plain pathlib and os, as fast as ever) or any writable fsspec URL
(`s3://bucket/run`, `gs://…`), the latter through `RemotePath`, a small pathlib-like handle.

`location(where)` turns a path or URL into a `Path` (local, `file://` included) or a `RemotePath`, and
the code that writes and reads an output folder (`datapipe.core.shards`, the curation runner, the
loader, `datapipe stats`) uses the few pathlib operations both have: `/`, `name`, `parent`, `exists`,
`is_file`, `is_dir`, `glob`, `iterdir`, `read_text`, `read_bytes`, `open`, `mkdir`, `unlink`.

On object storage every write goes to a temporary key next to the final one (`.NAME.tmp-PID-XXXXXXXX`,
the local temporary's name) and is moved to the final key when complete (`datapipe.core.shards.replacing`);
the manifest is written last. A remote file system is opened without a listings cache: work files are
written by tasks on other nodes, so a cached listing would be stale.

Credentials and endpoints come from the usual places of the file system's library: for S3 (s3fs,
botocore) `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` (a local or non-AWS server),
`AWS_DEFAULT_REGION`, or `FSSPEC_S3_*` variables (fsspec's configuration, read when fsspec is imported).
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import IO, Any, Iterator, Union

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

from datapipe.core.config import ConfigError

# Object stores have no folders: a key is written whatever "folders" its name has, and creating one
# (s3fs: HEAD and list the bucket, or create a missing bucket) would only cost requests or surprise.
FLAT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oci", "oss", "r2", "tos"})

# File systems fsspec knows that can only read: an output there can never be written.
READ_ONLY_PROTOCOLS = frozenset({"http", "https", "zip", "tar", "github", "git", "libarchive", "reference", "jlab"})

# Environment variables the remote file systems read (credentials, endpoint, region, fsspec config):
# passed on to every Ray task, so workers on other nodes reach the same storage as the driver.
STORAGE_ENV_PREFIXES = ("AWS_", "FSSPEC_")


def is_url(where: str | os.PathLike[str]) -> bool:
    """True for `scheme://…` other than `file://` (a local path written as a URL)."""
    text = str(where)
    return "://" in text and not text.startswith("file://")


def storage_env(environ: Any = os.environ) -> dict[str, str]:
    """The environment variables (`STORAGE_ENV_PREFIXES`) that remote file systems read, from `environ`."""
    return {k: v for k, v in environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def check_url(url: str, key: str, *, write: bool = True) -> None:
    """A ConfigError naming `key` unless `url` is a URL of a file system whose library is installed (and,
    with `write`, one datapipe can write to). Called before any work, so that a URL is never taken for a
    local folder."""
    protocol = url.split("://", 1)[0]
    if write and protocol in READ_ONLY_PROTOCOLS:
        raise ConfigError(f"{key}: {url!r} is on a read-only file system ({protocol}://): datapipe cannot write "
                          "there. Use a local folder or a writable object store URL (s3://bucket/folder, gs://…)")
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"{key}: {url!r} names a file system datapipe cannot use ({exc}). Use a local folder, "
                          "or an object store URL whose fsspec library is installed (s3:// needs `pip install s3fs`, "
                          "gs:// `pip install gcsfs`)") from None
    if write and (protocol == "memory" or getattr(cls, "protocol", None) == "memory"):
        raise ConfigError(f"{key}: {url!r} is fsspec's in-memory file system, which each process (and each Ray "
                          "worker) has its own copy of: nothing written there outlives the run. Use a local folder "
                          "or an object store URL (s3://bucket/folder)")


def reachable(where: Union[str, os.PathLike[str], "RemotePath"], key: str) -> Union[Path, "RemotePath"]:
    """`location(where)`, after one request to a remote folder: a ConfigError naming `key` and the URL when
    the storage cannot be reached (no credentials, wrong endpoint, access denied), before any work."""
    if isinstance(where, RemotePath) or is_url(os.fspath(where)):
        check_url(str(where), key, write=False)  # an unknown scheme, a package not installed
        where = location(where)
        try:
            where.exists()
        except Exception as exc:  # noqa: BLE001 - botocore's NoCredentialsError is no OSError; any failure says the same
            raise ConfigError(
                f"{key}: cannot reach {where.url} ({type(exc).__name__}: {exc}). Set the storage's credentials and "
                "endpoint in the environment (s3://: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, and "
                "AWS_ENDPOINT_URL for a server other than AWS), then run the same command again") from None
        return where
    return location(where)


def check_reachable(named: list[tuple[str, str | None]]) -> None:
    """`reachable` for each (key, path) whose path is a URL: one request each, so an input, a tokenizer or an
    eval set on storage that cannot be reached (no credentials, wrong endpoint) is a ConfigError naming the key
    before any work. A URL holding a glob is checked as written: the request fails the same way."""
    for key, where in named:
        if where is not None and is_url(where):
            reachable(where, key)


def make_local_folder(where: str | os.PathLike[str], key: str) -> None:
    """mkdir -p of a local output folder, or a ConfigError naming `key` that says what is wrong: a file stands at
    the path or above it, or the machine refuses (read-only, permission, no such device). Nothing for a URL."""
    if is_url(os.fspath(where)):
        return
    path = Path(os.fspath(where).removeprefix("file://"))
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker == path:
        raise ConfigError(f"{key}: {str(path)!r} is a file, not a folder; give a folder (new or existing) instead")
    if blocker is not None:
        raise ConfigError(f"{key}: cannot create the folder {str(path)!r}: {str(blocker)!r} is a file, not a folder; "
                          "give a folder elsewhere")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot create the folder {str(path)!r}: {exc.strerror or exc}; give a folder "
                          "you may write to") from None


def location(where: Union[str, os.PathLike[str], "RemotePath"]) -> Union[Path, "RemotePath"]:
    """A `Path` for a local path (or `file://` URL), a `RemotePath` for any other URL."""
    if isinstance(where, (Path, RemotePath)):
        return where
    text = os.fspath(where)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    return RemotePath(text) if is_url(text) else Path(text)


def absolute(where: str | os.PathLike[str]) -> str:
    """`where` as an absolute local path, or the URL itself (without a trailing slash)."""
    text = os.fspath(where)
    if is_url(text):
        return text.rstrip("/")
    return os.path.abspath(text.removeprefix("file://"))


PREFIXES = 256  # hashed key prefixes that `spread` keys go over on an object store


def size_of(path: Union[Path, "RemotePath"]) -> int:
    """A file's size in bytes, local or remote (an OSError when it is not there)."""
    return path.size() if isinstance(path, RemotePath) else path.stat().st_size


def spread(path: Union[Path, "RemotePath"]) -> Union[Path, "RemotePath"]:
    """Where a work object named `path` is kept: on an object store, below a folder named by a hash of its
    name (`.../pairs-u/3f/g001.shuffle`), so that a phase's many reads spread over PREFIXES key prefixes
    (S3 serves about 5,500 GETs a second per prefix, then answers 503 SlowDown); on a disk, at `path`.
    For the objects that many tasks read by range (shuffle files, read blocks); a folder removed whole
    (`remove_tree`) takes them with it."""
    if isinstance(path, RemotePath) and path.is_object_store:
        return path.parent / f"{xxhash.xxh3_64_intdigest(path.name.encode()) % PREFIXES:02x}" / path.name
    return path


def remove_tree(where: Union[str, os.PathLike[str], "RemotePath"]) -> None:
    """Delete a folder and everything under it; nothing when it does not exist."""
    where = location(where)
    if isinstance(where, RemotePath):
        if where.exists():
            where.fs.rm(where.path, recursive=True)
    else:
        shutil.rmtree(where, ignore_errors=True)


def remove_files(paths: list[Union[Path, "RemotePath"]]) -> None:
    """Delete files (on an object store in batch requests); nothing for one that is not there."""
    remote = [p for p in paths if isinstance(p, RemotePath)]
    if remote:
        remote[0].fs.rm([p.path for p in remote])  # s3fs: one DeleteObjects request per 1,000 keys
    for p in paths:
        if not isinstance(p, RemotePath):
            p.unlink(missing_ok=True)


# Connections of the S3 client: a receiving task asks for ranges of many files at once (fsspec's `cat_ranges`), and
# botocore's default pool of 10 would queue them; S3 answers each connection's request independently.
S3_CONNECTIONS = 64


def cat_ranges(fs: Any, paths: list[str], starts: list[int], ends: list[int], *, on_error: str = "raise") -> list[Any]:
    """fsspec's concurrent range reads, at most S3_CONNECTIONS in flight: as many as the client's pool holds
    (fsspec would start up to 1,280 at once, which then wait in the pool), a new one as each ends.
    `on_error="return"`: a range that fails is its exception in the list (which file is gone), not raised."""
    return fs.cat_ranges(paths, starts, ends, on_error=on_error, batch_size=S3_CONNECTIONS)


class RemotePath:
    """A file or folder of a remote fsspec file system, with the pathlib operations datapipe uses.
    Pickles as its URL (Ray tasks get it that way) and reopens the file system where it lands."""

    __slots__ = ("url", "fs", "path")

    def __init__(self, url: str, fs: Any = None, path: str | None = None) -> None:
        self.url = url.rstrip("/")
        if fs is None:
            options = {"config_kwargs": {"max_pool_connections": S3_CONNECTIONS}} if self.url.startswith("s3://") else {}
            fs, path = fsspec.core.url_to_fs(self.url, use_listings_cache=False, **options)
            if isinstance(fs, LocalFileSystem):
                raise ValueError(f"{url!r} is a local path: use pathlib.Path (storage.location does)")
        self.fs, self.path = fs, path.rstrip("/")

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return RemotePath, (self.url,)

    def __truediv__(self, part: str | os.PathLike[str]) -> "RemotePath":
        part = os.fspath(part).strip("/")
        return RemotePath(f"{self.url}/{part}", self.fs, f"{self.path}/{part}")

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __lt__(self, other: "RemotePath") -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.url.rsplit("/", 1)[0], self.fs, posixpath.dirname(self.path))

    def _child(self, fs_path: str) -> "RemotePath":
        fs_path = fs_path.rstrip("/")
        return self / fs_path[len(self.path) + 1:] if fs_path.startswith(self.path + "/") else \
            RemotePath(self.fs.unstrip_protocol(fs_path), self.fs, fs_path)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def glob(self, pattern: str) -> Iterator["RemotePath"]:
        """The files and folders below this folder that match `pattern`, in name order."""
        return iter(sorted(self._child(p) for p in self.fs.glob(f"{self.path}/{pattern}")))

    def iterdir(self) -> Iterator["RemotePath"]:
        if not self.fs.isdir(self.path):
            return iter([])
        return iter(sorted(self._child(p) for p in self.fs.ls(self.path, detail=False) if p.rstrip("/") != self.path))

    def walk_files(self) -> Iterator["RemotePath"]:
        """Every file below this folder (at any depth)."""
        return iter(sorted(self._child(p) for p in self.fs.find(self.path)))

    def read_bytes(self, *, small: bool = False) -> bytes:
        """The object's bytes. `small`: in one GET, where s3fs would first ask its size (a HEAD) to decide on a
        chunked, concurrent download, which only objects over its block size (50 MiB) take: a work file's read costs
        one request, not two."""
        if small and "s3" in _protocols(self.fs):
            return self.fs.cat_file(self.path, max_concurrency=1)
        return self.fs.cat_file(self.path)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "rb", **kwargs: Any) -> IO[Any]:
        return self.fs.open(self.path, mode, **kwargs)

    def size(self) -> int:
        return int(self.fs.size(self.path))

    @property
    def is_object_store(self) -> bool:
        """An object store (S3, GCS, Azure, ...): flat keys, no folders, and a PUT is atomic."""
        return bool(FLAT_PROTOCOLS.intersection(_protocols(self.fs)))

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        """Create the folder, on file systems that have folders (object stores have none)."""
        if not self.is_object_store:
            self.fs.makedirs(self.path, exist_ok=True)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def move_to(self, target: "RemotePath") -> None:
        """Rename (object stores: copy, then delete) this file to `target`, on the same file system."""
        self.fs.mv(self.path, target.path)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


Location = Union[Path, RemotePath]
"""A file or folder of an output: what `location` returns."""
