"""The streaming loader against nanoGPT's `get_batch` on the same tokens, side by side; prints one JSON object.

    python -m scripts.bench_loader_nanogpt --source CURATED_DIR [--shapes 1024x12,2048x8] [--batches 2000]
                                           [--rounds 3] [--profile]

The tokens are CURATED_DIR's shards (a `datapipe curate` output folder). nanoGPT reads them as its `prepare.py`
leaves a corpus: every document's tokens (the end-of-document id included) one after another in one uint16
`train.bin`, written once here; its `get_batch` is train.py's, on the CPU: a fresh `np.memmap` each call, `batch`
random offsets, `x` and `y` stacked from int64 copies. The loader is `PackedLoader` at `num_workers=0` (seq_len and
batch_size as nanoGPT's block_size and batch_size, shards verified as by default, warm cache), building packed rows
of whole documents with labels, positions, document and segment ids and `cu_seqlens`: more than nanoGPT hands over,
which is the point of the comparison.

For each shape (`SEQ_LENxBATCH`), `--rounds` rounds each time `--batches` batches of both, alternating, the consumer
doing nothing; tokens/s counts the batch's slots (batch x seq_len) over wall seconds, and the ratio is the loader's
over nanoGPT's (median of the rounds). One process, one thread for torch and numpy. `--profile` adds the loader's
top functions by their own time (cProfile) over one more round.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from datapipe.loader import PackedLoader  # noqa: E402

torch.set_num_threads(1)


def write_train_bin(source: Path, path: Path) -> int:
    """nanoGPT's train.bin of the shards' tokens, in manifest order; how many tokens."""
    manifest = json.loads((source / "manifest.json").read_text())
    total = 0
    with path.open("wb") as f:
        for shard in manifest["shards"]:
            with pa.memory_map(str(source / shard["path"])) as mm:
                tokens = pa.ipc.open_file(mm).read_all().column("tokens").combine_chunks().values.to_numpy()
            if tokens.max(initial=0) >= 2**16:
                raise SystemExit(f"{shard['path']} holds ids past uint16: nanoGPT's train.bin cannot hold them")
            f.write(tokens.astype(np.uint16).tobytes())
            total += len(tokens)
    return total


def nanogpt_batches(train_bin: Path, block_size: int, batch_size: int) -> Callable[[], Any]:
    """nanoGPT's train.py `get_batch('train')` on the CPU (device_type 'cpu': no pinned memory)."""
    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        # We recreate np.memmap every batch to avoid a memory leak, as per
        # https://stackoverflow.com/questions/45132940/numpy-memmap-memory-usage-want-to-iterate-once/61472122#61472122
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x, y
    return get_batch


def loader_batches(source: Path, seq_len: int, batch_size: int) -> Callable[[], Any]:
    iterator = iter(PackedLoader(source, seq_len=seq_len, batch_size=batch_size, seed=0, epochs=None))
    return lambda: next(iterator)


def timed(next_batch: Callable[[], Any], batches: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `batches` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next_batch()
    return time.perf_counter() - wall, time.process_time() - cpu


def profile(next_batch: Callable[[], Any], batches: int, top: int = 15) -> list[str]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(batches):
        next_batch()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, type=Path, help="a curated output folder")
    parser.add_argument("--shapes", default="1024x12,2048x8", help="SEQ_LENxBATCH, comma-separated")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {"source": str(args.source), "torch": torch.__version__, "numpy": np.__version__}
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as tmp:
        train_bin = Path(tmp) / "train.bin"
        results["tokens"] = write_train_bin(args.source, train_bin)
        for shape in args.shapes.split(","):
            seq_len, batch_size = map(int, shape.split("x"))
            arms = {"nanogpt": nanogpt_batches(train_bin, seq_len, batch_size),
                    "loader": loader_batches(args.source, seq_len, batch_size)}
            for next_batch in arms.values():  # first batch (shards opened, verified) untimed
                next_batch()
            rates: dict[str, list[float]] = {name: [] for name in arms}
            cpu_rates: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, next_batch in arms.items():
                    wall, cpu = timed(next_batch, args.batches)
                    rates[name].append(args.batches * seq_len * batch_size / wall / 1e6)
                    cpu_rates[name].append(args.batches * seq_len * batch_size / cpu / 1e6)
            ratio = [lo / na for lo, na in zip(rates["loader"], rates["nanogpt"])]
            results[shape] = {
                "Mtokens_per_s": {name: [round(r, 1) for r in v] for name, v in rates.items()},
                "Mtokens_per_cpu_s": {name: [round(r, 1) for r in v] for name, v in cpu_rates.items()},
                "loader_over_nanogpt": [round(r, 3) for r in ratio],
                "loader_over_nanogpt_median": round(statistics.median(ratio), 3),
            }
            if args.profile:
                results[shape]["loader_profile"] = profile(arms["loader"], args.batches)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
