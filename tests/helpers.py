"""Small helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
import zstandard

from datapipe.core.config import from_dict
from datapipe.curation.config import CurateConfig
from datapipe.loader.packing import block_causal_mask
from datapipe.testing.shards import write_fake_shards
from datapipe.train.config import TrainConfig, load_train_config

ASSETS = Path(__file__).parent / "assets"


# The Ray tests' stall watchdog (`ray.stall_timeout_s`), well under pytest's 600 s timeout: a phase whose tasks
# stop finishing (workers that never start on a loaded machine) fails with the executor's diagnosis, not a kill.
STALL_S = 120


def small_config(out_dir: Path | str, inputs: list[dict[str, Any]], **sections: Any) -> CurateConfig:
    """A fast config: tiny blocks (many tasks), a tiny tokenizer, tiny shards."""
    data: dict[str, Any] = {
        "inputs": inputs,
        "read": {"block_bytes": 8192, "batch_size": 16},
        "dedup": {"exact": {"partitions": 3}},
        "filters": {"code": {"code": {}}},
        "tokenizer": {"train": {"vocab_size": 400, "sample_bytes": 200_000}},
        "output": {"dir": str(out_dir), "shard_bytes": 8192},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return from_dict(CurateConfig, data)


def with_eos_at(tokenizer_json: str, eos_id: int, eos_token: str = "<|endoftext|>") -> str:
    """The same tokenizer with its EOS moved to id `eos_id`, leaving a gap in the ids: a small
    vocabulary whose largest id is far beyond its token count (as when a special token is added late)."""
    data = json.loads(tokenizer_json)
    data["model"]["vocab"][eos_token] = eos_id
    for added in data["added_tokens"]:
        if added["content"] == eos_token:
            added["id"] = eos_id
    return json.dumps(data)


# ---------------------------------------------------------------- loader tests: every token names its document
# Document g's token k is g * STRIDE + k + 1 and its last token is EOS (0), so a served batch can be checked token by token.

STRIDE = 10_000
EOS = 0



def doc_tokens(g: int, n: int) -> list[int]:
    return [g * STRIDE + k + 1 for k in range(n - 1)] + [EOS]


def write_source(out: Path, shard_docs: list[list[tuple[str, int]]], *, scores: bool = False) -> dict[int, list[int]]:
    """Shards of documents given as (domain, length) per shard; returns {global doc id: tokens}."""
    docs, specs, g = {}, [], 0
    for spec in shard_docs:
        shard = []
        for domain, n in spec:
            docs[g] = doc_tokens(g, n)
            doc = {"id": f"d{g}", "domain": domain, "tokens": docs[g]}
            if scores:  # a difficulty score unrelated to length: the document id modulo 7
                doc["score"] = float(g % 7)
            shard.append(doc)
            g += 1
        specs.append(shard)
    vocab = max(2**24, g * STRIDE)  # every token id below it (the loader checks)
    write_fake_shards(out, specs, vocab_size=vocab, dtype="uint32", eos_id=EOS)
    return docs


def mixed_shards(seed: int = 0, n_shards: int = 6, per_shard: int = 40, high: int = 300) -> list[list[tuple[str, int]]]:
    """Domain-clustered shards like curated ones (most hold one domain), long-tailed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n_shards):
        domains = ["web"] * 3 + ["code"] * 2 + ["book"]
        base = domains[s % len(domains)]
        spec = []
        for _ in range(per_shard):
            d = base if s != 2 or rng.random() < 0.5 else "book"
            spec.append((d, int(min(rng.lognormal(4.0, 1.0) + 2, high))))
        out.append(spec)
    return out


def check_batch(b: dict, docs: dict[int, list[int]], seq_len: int, batch_size: int) -> None:
    """Every packing invariant, checked against the original documents."""
    for key in ("input_ids", "labels", "position_ids", "doc_ids"):
        assert b[key].shape == (batch_size, seq_len) and b[key].dtype == torch.int64
    cu = b["cu_seqlens"].tolist()
    assert b["cu_seqlens"].dtype == torch.int32 and cu[0] == 0 and cu[-1] == batch_size * seq_len
    ids, labels = b["input_ids"].reshape(-1).tolist(), b["labels"].reshape(-1).tolist()
    pos, doc = b["position_ids"].reshape(-1).tolist(), b["doc_ids"].reshape(-1).tolist()
    for a, z in zip(cu[:-1], cu[1:]):
        assert a // seq_len == (z - 1) // seq_len  # a segment never spans two rows
        assert pos[a:z] == list(range(z - a))  # positions restart at every segment
        assert len(set(doc[a:z])) == 1
        g = doc[a]
        if g < 0:  # padding: no loss
            assert all(x == -100 for x in labels[a:z])
            continue
        toks = docs[g]
        start = len(toks) - 1 if ids[a] == EOS else ids[a] - g * STRIDE - 1  # EOS only ends a document
        assert ids[a:z] == toks[start : start + z - a]  # a contiguous range of one document
        nxt = toks[start + 1 : start + z - a + 1]  # labels: the next token of the same document ...
        want = nxt + [-100] * (z - a - len(nxt))  # ... and -100 where the document ends
        assert labels[a:z] == want
    # attention: each query sees exactly the earlier tokens of its own piece (the cu_seqlens span),
    # built here from the spans and compared with the mask of the batch's segments
    want = torch.zeros(batch_size, seq_len, seq_len, dtype=torch.bool)
    for a, z in zip(cu[:-1], cu[1:]):
        r, i = divmod(a, seq_len)
        want[r, i : i + z - a, i : i + z - a] = torch.ones(z - a, z - a, dtype=torch.bool).tril()
    assert torch.equal(block_causal_mask(b["segment_ids"]), want)


# ---------------------------------------------------------------- trainer tests: tiny learnable shards

VOCAB = 64



def write_train_source(out: Path, n_shards: int = 3, per_shard: int = 30) -> Path:
    """Tiny curated-like shards: two domains, documents of 10-90 tokens with a learnable pattern."""
    rng = np.random.default_rng(0)
    specs, g = [], 0
    for s in range(n_shards):
        shard = []
        for i in range(per_shard):
            n = int(rng.integers(10, 90))
            start = int(rng.integers(1, VOCAB))
            toks = [(start + 3 * k) % (VOCAB - 1) + 1 for k in range(n - 1)] + [0]
            shard.append({"id": f"d{g}", "domain": "code" if (s + i) % 2 else "prose", "tokens": toks})
            g += 1
        specs.append(shard)
    write_fake_shards(out, specs, vocab_size=VOCAB, dtype="uint16")
    return out


def tiny_cfg(source: Path, output: Path, *overrides: str) -> TrainConfig:
    base = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=64", "data.seq_len=64",
            "data.batch_size=2", "data.holdout_shards=1", "data.eval_batches=1", "train.steps=10",
            "train.log_every=2", "train.eval_every=5", "train.ckpt_every=5", "optim.lr=0.01", "prefetch.depth=2"]
    return load_train_config(None, base + list(overrides), data=str(source), output=str(output))


def stop_cluster(marks: list[str]) -> None:
    """Kill this cluster's processes and their children, and nothing else: `ray stop` would also
    kill every other Ray on the machine (the session's embedded one, a user's own)."""
    rows = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        rows.append((int(proc.name), ppid, args))
    doomed = {pid for pid, _, args in rows if any(m in args for m in marks) and pid != os.getpid()}
    while True:
        more = {pid for pid, ppid, _ in rows if ppid in doomed} - doomed
        if not more:
            break
        doomed |= more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- damaged compressed inputs: one flipped bit


def gzip_member_with_a_flipped_bit(data: bytes) -> bytes:
    """`data` (JSON lines) as one gzip member with one bit flipped past its first third that zlib still
    inflates to the end, where only the CRC-32 tells, into as many lines, some of them changed yet still
    JSON objects with a text: the damage that handed garbled records to the shards. The first such bit,
    so the same one on every run (found rather than fixed: zlib builds differ in what they write)."""
    member = gzip.compress(data, mtime=0)  # a 10-byte header: no file name
    lines = data.split(b"\n")
    for at in range(len(member) // 3, len(member) - 8):
        for bit in range(8):
            flipped = bytearray(member)
            flipped[at] ^= 1 << bit
            inflate = zlib.decompressobj(-15)
            try:
                out = inflate.decompress(bytes(flipped[10:]))
            except zlib.error:
                continue
            garbled = [new for new, old in zip(out.split(b"\n"), lines) if new != old]
            if inflate.eof and out.count(b"\n") == len(lines) - 1 and out.endswith(b"\n") and any(
                    _is_record(line) for line in garbled):
                return bytes(flipped)
    raise AssertionError("no bit of the member gives garbled records")


def _is_record(line: bytes) -> bool:
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(rec, dict) and isinstance(rec.get("text"), str)


def zstd_frame_with_a_flipped_bit(data: bytes) -> bytes:
    """`data` as one zstd frame with a content checksum (`write_checksum=True`) and one bit flipped past its
    middle that zstandard refuses (a failed checksum, or data it cannot decode). The first such bit."""
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    for at in range(len(frame) // 2, len(frame)):
        for bit in range(8):
            flipped = bytearray(frame)
            flipped[at] ^= 1 << bit
            try:
                zstandard.ZstdDecompressor().decompress(bytes(flipped))
            except zstandard.ZstdError:
                return bytes(flipped)
    raise AssertionError("no bit of the frame is refused")


# ---------------------------------------------------------------- a writer killed in the middle of a write


def killed_mid_write(code: str, *args: str) -> str:
    """Run Python `code` (argv: `args`) in a child process that prints one line once it is in the middle of
    a write and then waits; SIGKILL it there, as the OOM killer or a dead node would. Returns the line
    (typically the temporary file it was writing)."""
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        assert line, "the child ended before its write"
    finally:
        child.kill()  # SIGKILL
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return line


def run_tasks_in_process():
    """The run loop's `run_tasks` (task records checked as in a run) over an in-process executor: for tests that
    drive a multi-step phase (near copies, diversity cuts) without a whole run."""
    import time

    from datapipe.curation.executors import LocalExecutor
    from datapipe.curation.run_loop import Run

    return Run(LocalExecutor(), progress=False, resumed=False, started=time.perf_counter()).tasks("test")


class Interrupted(BaseException):
    """What `CrashAfter` raises: a run killed mid-way. A BaseException, as KeyboardInterrupt is: a kill is no error of
    the stage's, which a stage's wrapper would name (`UserStageFailed`)."""


class CrashAfter:
    """A user stage (in the filters' segment) that raises once it has seen `n` batches: a run killed mid-way."""

    name = "crash"

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, batch):
        from datapipe.core.schema import empty_dropped
        from stages.base import StageResult

        self.n -= 1
        if self.n < 0:
            raise Interrupted("killed")
        return StageResult(batch, empty_dropped())


class PassThrough(CrashAfter):
    """`CrashAfter` that never crashes: the same stages, so the same config, for the run that finishes."""

    def __init__(self) -> None:
        super().__init__(10**9)


def damage(path: Path, how: str) -> None:
    """Damage a file as a crash or a bad disk would: `cut` to half, `emptied`, one `bit` flipped near its end (the last
    partition's rows of a shuffle, a table's footer side, a record's end), or `deleted`."""
    data = path.read_bytes()
    if how == "cut":
        path.write_bytes(data[: len(data) // 2])
    elif how == "emptied":  # what an unsynced rename can leave after a power loss
        path.write_bytes(b"")
    elif how == "bit":
        flipped = bytearray(data)
        flipped[max(0, len(data) - 40)] ^= 0x01
        path.write_bytes(bytes(flipped))
    elif how == "deleted":
        path.unlink()
    else:
        raise ValueError(f"unknown damage {how!r}")
