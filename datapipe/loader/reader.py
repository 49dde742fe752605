"""The loader's shard reading: the manifest's layout and the shards it names, opened lazily and cached.

`Layout` arranges what the manifest says (shard paths, rows, per-domain counts, tokenizer) for
planning and opens no shard. `Reader` opens shards through `datapipe.core.shards` when a document
of theirs is needed and serves a document's tokens, a shard's lengths, a domain's rows, a numeric
column, and the documents' static features for prioritization. A `Reader` is thread-safe: the
loader's iteration and the trainer's loss reports share one.

Open shards (local shards are memory-mapped) stay open while someone holds them, plus the
`cache_shards` most recently used others. Holders are `ShardHolds` objects that the planner owns:
one for the shards of the pieces waiting to be built into a batch, one per domain for the shards
of its current shuffle window. So each shard is opened once while its documents are drawn and
built, however many shards the corpus has (an LRU alone reopened small shards up to 12 times each:
BENCHMARKS.md). A hold dies with its owner: the reader refers to holders weakly.

Verification (`ShardVerifier`, on by default). The first time a shard is opened, before any of its
tokens or lengths is used, its size is compared with the manifest's `bytes`, its sha256 is computed
by streaming the file and compared with the manifest's, and its token ids must all be below the
manifest's tokenizer `vocab_size`; a shard that fails raises `ShardError` naming it. A shard that
passed is remembered by (path, size, modification time): in the process, and in a small log per
source folder under `$DATAPIPE_CACHE_DIR/verified` (default `~/.cache/datapipe`), so DataLoader
workers, a resumed run or a reopened shard do not hash it again; a rewritten shard has a new stamp
and is checked again. That trusts the stamp: bytes that rot in place with the size and modification
time kept (a disk or copy fault, a tool that restores times) are served. `verify="always"` hashes a
shard on every open instead. A shard that is gone raises `ShardError` too, verified or not.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fsspec.implementations.local import LocalFileSystem

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import prioritize as prio
from datapipe.loader.packing import served_lengths


class Layout:
    """What the manifest says, arranged for planning: no shard is opened here."""

    def __init__(self, manifest: Mapping[str, Any]) -> None:
        infos = manifest["shards"]
        self.paths = [s["path"] for s in infos]
        self.sha256 = [s["sha256"] for s in infos]
        self.bytes = [s.get("bytes") for s in infos]  # file size in bytes (None: not recorded)
        rows = np.array([int(s["rows"]) for s in infos], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # global doc id of each shard's row 0
        self._offsets = self.offsets.tolist()  # for bisect: a scalar lookup per piece, 10x cheaper than numpy's
        self.domains = tuple(sorted(d for d, c in manifest.get("domains", {}).items() if c.get("docs", 0) > 0))
        self.domain_docs = {
            d: np.array([int(s.get("domains", {}).get(d, {}).get("docs", 0)) for s in infos], dtype=np.int64)
            for d in self.domains
        }
        self.domain_tokens = {
            d: np.array([int(s.get("domains", {}).get(d, {}).get("tokens", 0)) for s in infos], dtype=np.int64)
            for d in self.domains
        }
        self.single_domain = [len(s.get("domains", {})) == 1 for s in infos]
        self.total_tokens = int(manifest.get("total_tokens", 0))
        self.eos_id = int(manifest.get("tokenizer", {}).get("eos_id", 0))
        vocab = manifest.get("tokenizer", {}).get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) else None
        # token ids travel from workers as int32 unless the vocabulary could overflow it
        self.wire_dtype = np.int32 if isinstance(vocab, int) and vocab < 2**31 else np.int64
        digest = hashlib.sha256("".join(s["sha256"] for s in infos).encode()).hexdigest()
        self.fingerprint = digest[:16]

    def shard_of(self, doc: int) -> int:
        """The shard that holds global document `doc`."""
        return bisect.bisect_right(self._offsets, doc) - 1

    def shards_of(self, docs: np.ndarray) -> np.ndarray:
        """`shard_of` of each of many documents at once."""
        return np.searchsorted(self.offsets, docs, side="right") - 1


class ShardError(ConfigError):
    """A shard that is missing or does not match its manifest entry (size, checksum or token ids); the message
    names it and what to do."""


def check_verify(value: Any) -> bool | str:
    """`verify` as given when it is True (check a shard once, then remember the pass), 'always' (on every open)
    or False; else a ConfigError saying what is allowed."""
    if not (isinstance(value, bool) or value == "always"):
        raise ConfigError(f"verify must be True (check each shard when first opened, then trust its size and "
                          f"modification time), 'always' (hash it on every open) or False, got {value!r}")
    return value


def verified_cache_dir() -> Path:
    """Where passed shard checks are remembered: $DATAPIPE_CACHE_DIR/verified, default ~/.cache/datapipe/verified."""
    return Path(os.environ.get("DATAPIPE_CACHE_DIR") or Path.home() / ".cache" / "datapipe") / "verified"


class ShardVerifier:
    """Checks each shard once against the manifest: size, streaming sha256, token ids < vocab_size.

    A pass is remembered by a stamp, the hash of (location, size, modification time, manifest
    checksum, vocab_size): in this process (a reopen then costs one stat) and as a line appended to
    one log per source folder under `verified_cache_dir()` (appends of one short line are atomic,
    so concurrent workers never conflict; a torn line matches nothing). Without a modification time
    (some remote file systems) a pass is remembered in this process only. With `always`, nothing is
    remembered: every open hashes the shard (in-place bit rot that kept size and time is then caught).
    """

    def __init__(self, source: str, layout: Layout, always: bool = False) -> None:
        self.source, self.layout, self.always = source, layout, always
        fs, root = fsspec.core.url_to_fs(source)
        self._local_root = os.path.realpath(root) if isinstance(fs, LocalFileSystem) else None
        where = self._local_root or f"{fs.protocol}://{root}"
        self.log = verified_cache_dir() / f"{hashlib.sha256(where.encode()).hexdigest()[:32]}.txt"
        self._logged: set[str] = set()  # the log's stamps read so far
        self._log_read = 0  # bytes of the log read so far
        self._where: dict[int, tuple[Any, str]] = {}  # shard -> (file system, path)
        self._passed: dict[int, tuple[int, Any]] = {}  # shard -> (size, mtime) of its last pass

    def _stat(self, s: int) -> tuple[Any, str, int, Any]:
        """(file system, path, size in bytes, modification time or None) of shard s."""
        where = self._where.get(s)
        if where is None:
            if self._local_root is not None:  # held-out subsets link their shards: the real file is checked
                where = (LocalFileSystem(), os.path.realpath(os.path.join(self._local_root, self.layout.paths[s])))
            else:
                where = fsspec.core.url_to_fs(self.source.rstrip("/") + "/" + self.layout.paths[s])
            self._where[s] = where
        fs, path = where
        if isinstance(fs, LocalFileSystem):
            st = os.stat(path)
            return fs, path, st.st_size, st.st_mtime_ns
        info = fs.info(path)
        # An object store's ETag changes with the content (a rewritten object has a new one); else a time.
        mtime = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created") if info.get(k)), None)
        return fs, path, int(info["size"]), mtime

    def _in_log(self, stamp: str) -> bool:
        if stamp not in self._logged:  # read what was appended since (by this or another process)
            try:
                with open(self.log, "rb") as f:
                    f.seek(self._log_read)
                    tail = f.read()
            except OSError:
                tail = b""
            complete = tail.rfind(b"\n") + 1  # a line being written now is read next time
            self._logged.update(tail[:complete].decode(errors="replace").split())
            self._log_read += complete
        return stamp in self._logged

    def _remember(self, stamp: str) -> None:
        try:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{stamp}\n".encode())
            finally:
                os.close(fd)
        except OSError:  # a read-only cache only costs a re-check in the next process
            pass

    def check(self, s: int, open_shard: Callable[[], "ShardData"]) -> "ShardData":
        """Verify shard s unless it passed before, then return `open_shard()` (the shard opened)."""
        fs, path, size, mtime = self._stat(s)
        if not self.always and self._passed.get(s) == (size, mtime):
            return open_shard()
        name = self.layout.paths[s]
        expected = self.layout.bytes[s]
        if expected is not None and size != int(expected):
            raise ShardError(f"shard {name} of {self.source} is {size:,} bytes but the manifest says {int(expected):,} "
                             "(truncated or replaced); restore it or curate the folder again")
        stamp = hashlib.sha256(repr((fs.protocol, path, size, mtime, self.layout.sha256[s],
                                     self.layout.vocab_size)).encode()).hexdigest()
        if not self.always and mtime is not None and self._in_log(stamp):
            self._passed[s] = (size, mtime)
            return open_shard()
        with fs.open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != self.layout.sha256[s]:
            raise ShardError(f"shard {name} of {self.source} has sha256 {digest} but the manifest says "
                             f"{self.layout.sha256[s]} (corrupted or replaced); restore it or curate the folder again")
        data = open_shard()
        vocab = self.layout.vocab_size
        if vocab is not None and len(data.values) and int(data.values.max()) >= vocab:
            bad = int(np.count_nonzero(data.values >= vocab))
            raise ShardError(f"shard {name} of {self.source} holds {bad:,} token ids >= the manifest's tokenizer "
                             f"vocab_size={vocab} (the largest is {int(data.values.max())}); the shards and the "
                             "tokenizer do not belong together: curate the folder again")
        if not self.always:
            self._passed[s] = (size, mtime)
            if mtime is not None:
                self._remember(stamp)
        return data


class ShardData:
    __slots__ = ("table", "offsets", "values", "lengths", "domain_rows", "columns", "token_columns")

    def __init__(self, table: Any) -> None:
        self.table = table
        column = table.column("tokens")
        tokens = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()  # one chunk: no copy
        # the offsets straight from their buffer (pyarrow's `.offsets` builds an array first)
        offset_type = np.int64 if pa.types.is_large_list(tokens.type) else np.int32
        offsets = np.frombuffer(tokens.buffers()[1], dtype=offset_type)[tokens.offset:tokens.offset + len(tokens) + 1]
        self.offsets = offsets.astype(np.int64)
        self.values = tokens.values.to_numpy(zero_copy_only=False)
        self.lengths = table.column("num_tokens").to_numpy()
        self.domain_rows: dict[str, np.ndarray] = {}
        self.columns: dict[str, np.ndarray] = {}
        self.token_columns: dict[str, tuple[np.ndarray, np.ndarray]] = {}


class ShardHolds:
    """Shards that one owner still needs, with a count each: the reader keeps them open while this
    object lives (see the module docstring). Get one from `Reader.holds()`."""

    __slots__ = ("counts", "__weakref__")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, s: int) -> None:
        self.counts[s] = self.counts.get(s, 0) + 1

    def remove(self, s: int) -> None:
        n = self.counts[s] - 1
        if n:
            self.counts[s] = n
        else:
            del self.counts[s]


class Reader:
    """Shards opened through `datapipe.core.shards`: those held open (`holds()`) plus an LRU of
    `cache_shards` others (local shards are memory-mapped).

    Thread-safe: the loader's iteration and the trainer's loss reports (document features) share one.
    """

    def __init__(self, source: str, layout: Layout, cache_shards: int, verify: bool | str = True) -> None:
        self.source = source
        self.layout = layout
        self.cache_shards = cache_shards
        verify = check_verify(verify)
        self.verifier = ShardVerifier(source, layout, always=verify == "always") if verify else None
        self._cache: OrderedDict[int, ShardData] = OrderedDict()
        self._holders: weakref.WeakSet[ShardHolds] = weakref.WeakSet()
        self._evict_at = cache_shards  # the cache size that triggers the next eviction
        self._lock = threading.RLock()
        self._ref: tuple[np.ndarray, np.ndarray] | None = None
        self._served: dict[tuple[int, str, str, int], int] = {}

    def _shard(self, s: int) -> ShardData:
        with self._lock:
            data = self._cache.get(s)
            if data is None:
                try:
                    data = self.verifier.check(s, lambda: self._open(s)) if self.verifier else self._open(s)
                except FileNotFoundError as exc:  # deleted (or a held-out subset's link left dangling)
                    raise ShardError(
                        f"shard {self.layout.paths[s]} of {self.source} is missing ({exc.filename or exc}); the "
                        "manifest names it: restore the file, or curate the folder again") from None
                self._cache[s] = data
                self._evict(keep=s)
            else:
                self._cache.move_to_end(s)
            return data

    def holds(self) -> ShardHolds:
        """A new, empty set of holds: the shards added to it stay open while it lives."""
        holds = ShardHolds()
        with self._lock:
            self._holders.add(holds)
        return holds

    def _evict(self, keep: int) -> None:
        """Close the least recently used shards that nobody holds, down to `cache_shards` unheld.

        Checked in steps of a quarter of `cache_shards` opens: gathering the holds costs more than an open.
        """
        if len(self._cache) <= self._evict_at:
            return
        held = set().union(*(h.counts for h in list(self._holders)))
        excess = len(self._cache.keys() - held) - self.cache_shards
        for s in [s for s in self._cache if s not in held and s != keep][:max(excess, 0)]:
            del self._cache[s]
        self._evict_at = max(len(self._cache), self.cache_shards) + max(self.cache_shards // 4, 1) - 1

    def _open(self, s: int) -> ShardData:
        return ShardData(shards.open_shard(self.source, self.layout.paths[s]))

    def domain_rows(self, s: int, domain: str) -> np.ndarray:
        """The rows of shard s that belong to `domain`, ascending."""
        if self.layout.single_domain[s]:  # the manifest says so: no read needed
            return np.arange(int(self.layout.domain_docs[domain][s]), dtype=np.int64)
        return self._domain_rows(self._shard(s), domain)

    def _domain_rows(self, data: ShardData, domain: str) -> np.ndarray:
        rows = data.domain_rows.get(domain)
        if rows is None:
            mask = pc.equal(data.table.column("domain"), domain).to_numpy(zero_copy_only=False)
            rows = data.domain_rows[domain] = np.flatnonzero(mask).astype(np.int64)
        return rows

    def domain_row(self, s: int, domain: str, x: int) -> int:
        """The row of the x-th document of `domain` in shard s."""
        if self.layout.single_domain[s]:
            return x
        return int(self.domain_rows(s, domain)[x])

    def lengths(self, s: int) -> np.ndarray:
        return self._shard(s).lengths

    def served_tokens(self, s: int, domain: str, policy: str, seq_len: int) -> int:
        """The tokens of `domain` in shard s that a long-document policy serves (read once, then remembered)."""
        key = (s, domain, policy, seq_len)
        n = self._served.get(key)
        if n is None:
            lens = self.lengths(s)[self.domain_rows(s, domain)]
            n = self._served[key] = int(served_lengths(lens, seq_len, policy).sum())
        return n

    def column(self, s: int, name: str, *, key: str = "curriculum.column", fix: str = "") -> np.ndarray:
        """Numeric column `name` of shard s as float64; a missing one is a ConfigError naming `key` (and `fix`)."""
        data = self._shard(s)
        col = data.columns.get(name)
        if col is None:
            if name not in data.table.column_names:
                raise ConfigError(
                    f"{key} must name a column of the shards, got {name!r}; "
                    f"{self.layout.paths[s]} has {data.table.column_names!r}{fix}")
            col = data.columns[name] = data.table.column(name).to_numpy().astype(np.float64)
        return col

    def token_column(self, s: int, name: str, *, key: str = "token_columns",
                     fix: str = "") -> tuple[np.ndarray, np.ndarray]:
        """List column `name` of shard s, one value per token of each document: (offsets, float32 values), document
        row r's values being values[offsets[r]:offsets[r + 1]]. A missing column, a column that is not a list of
        numbers, or one whose lists are not as long as the documents is a ConfigError naming `key` (and `fix`)."""
        data = self._shard(s)
        col = data.token_columns.get(name)
        if col is None:
            where = self.layout.paths[s]
            if name not in data.table.column_names:
                raise ConfigError(f"{key} must name a column of the shards, got {name!r}; {where} has "
                                  f"{data.table.column_names!r}{fix}")
            arr = data.table.column(name).combine_chunks()
            if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) \
                    or not (pa.types.is_floating(arr.type.value_type) or pa.types.is_integer(arr.type.value_type)):
                raise ConfigError(f"{key} must name a column of per-token numeric lists aligned with `tokens`; column "
                                  f"{name!r} of {where} is {arr.type}, not a list per document{fix}")
            offsets = arr.offsets.to_numpy().astype(np.int64)  # raw offsets into arr.values
            if len(offsets) != len(data.offsets) or not np.array_equal(np.diff(offsets), np.diff(data.offsets)):
                raise ConfigError(f"{key}: column {name!r} of {where} does not hold one value per token of each "
                                  f"document (its lists' lengths differ from `tokens`){fix}")
            col = data.token_columns[name] = (offsets, arr.values.to_numpy(zero_copy_only=False).astype(np.float32))
        return col

    def token_values(self, doc: int, name: str, *, key: str = "token_columns", fix: str = "") -> np.ndarray:
        """The per-token values of column `name` of one document (float32, as long as its tokens)."""
        s = self.layout.shard_of(doc)
        offsets, values = self.token_column(s, name, key=key, fix=fix)
        row = doc - int(self.layout.offsets[s])
        return values[offsets[row] : offsets[row + 1]]

    def features(self, docs: Sequence[int], cfg: prio.Prioritize) -> np.ndarray:
        """The static features (prioritize.FEATURES) of documents, one row each; opens their shards."""
        with self._lock:
            if self._ref is None:
                arrays = (self._shard(s).values for s in range(len(self.layout.paths)))
                self._ref = prio.reference_log_freq(arrays, cfg.ref_tokens, self._vocab_size())
            table = self._ref
        return np.stack([prio.features(self.tokens(int(d)), table[0], table[1], cfg.rare_count) for d in docs]) \
            if len(docs) else np.zeros((0, len(prio.FEATURES)))

    def _vocab_size(self) -> int | None:
        v = getattr(self.layout, "vocab_size", None)
        return v if isinstance(v, int) and v <= 1 << 22 else None

    def tokens(self, doc: int) -> np.ndarray:
        s = self.layout.shard_of(doc)
        data = self._shard(s)
        row = doc - int(self.layout.offsets[s])
        return data.values[data.offsets[row] : data.offsets[row + 1]]
