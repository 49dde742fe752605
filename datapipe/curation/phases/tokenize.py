"""The tokenizer and the tokenize phase.

The tokenizer is loaded (`tokenizer.path`) or trained once on a deterministic sample of the kept text, taken by
one task per block (`sample_rows`: the documents whose id hashes below a rate), combined, and trained on by one
task (`train_task`), each recorded. Then one task per block encodes
its kept documents into `work/tokens/<block>.arrow` (and their lengths, for shard planning); each worker process
builds the tokenizer once (`_tokenize_stage`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.shards import atomic_write_bytes, shard_schema
from datapipe.core.exchange import Received, Shuffle, routed, run_maps
from datapipe.core.storage import Location, is_url, location
from datapipe.core.workfiles import DamagedWorkFile, write_work_table
from datapipe.curation.blocks import block_documents
from datapipe.curation.counters import Counters
from datapipe.curation.phase import Phase, record_location
from datapipe.curation.plan import WORK_COMPRESSION, Plan, block_name, lengths_file, task_memory, token_file
from stages.fast_bpe import CompiledBPE, try_compile
from stages.sampling import seeded_sample
from stages.tokenize import TokenizeStage, TokenizerConfig, train_tokenizer


SAMPLE_DIR = "tokenizer"  # work/tokenizer/: the training sample (sample/<block>.shuffle, combined) and the records
SAMPLE_SCHEMA = pa.schema([("text", pa.large_string())])
TRAIN_BYTES_PER_SAMPLE_BYTE = 8  # the training task's memory, about, per byte of its sample (texts, then word counts)


def sample_exchange(plan: Plan) -> Shuffle:
    """The tokenizer's sample: every block's part (`work/tokenizer/sample/<block>.shuffle`, one partition) to the one
    training task, in block order."""
    return Shuffle("tokenizer sample", str(plan.work / SAMPLE_DIR / "sample"), 1,
                   records=str(plan.work / SAMPLE_DIR / "records"), sender_record="sample-", map_step="", schema=SAMPLE_SCHEMA)


def sample_rows(shared: tuple[Plan, float], block: str) -> tuple[pa.Table, np.ndarray, dict[str, int]]:
    """The block's part of the tokenizer's training sample: the kept documents whose id hashes below the rate."""
    plan, rate = shared

    def sampled(view: pa.Table) -> np.ndarray:  # picked from the ids before any text is decompressed
        return np.flatnonzero(seeded_sample(view.column("id").to_pylist(), rate))

    texts = block_documents(plan.work, plan.segments[-1].name, block, ["text"], where=sampled).column("text").to_pylist()
    sample = pa.table({"text": pa.array(texts, pa.large_string())}, schema=SAMPLE_SCHEMA)
    text_bytes = int(pc.sum(pc.binary_length(sample.column("text"))).as_py() or 0)
    return sample, np.zeros(len(texts), np.int64), {"documents": len(texts), "text_bytes": text_bytes}


@dataclass(frozen=True)
class TrainTask:
    """What the training task reads: the run's plan and where the blocks' sample files were routed."""

    plan: Plan
    sample: Received


def train_task(task: TrainTask) -> dict[str, str]:
    """The tokenizer trained on the sample files (as routed), in block order, written atomically to OUT/tokenizer.json;
    its sha256 recorded, so that a resume can tell the file is still what the tokens were made with."""
    plan, sample = task.plan, task.sample.read(0, SAMPLE_SCHEMA)
    text = train_tokenizer(iter(sample.column("text").to_pylist()), plan.cfg.tokenizer).to_str().encode()
    atomic_write_bytes(plan.out / "tokenizer.json", text, durable=True)
    return {"path": "tokenizer.json", "sha256": hashlib.sha256(text).hexdigest()}


def _train_record(task: TrainTask) -> Location:
    return task.plan.work / SAMPLE_DIR / "records" / "train.json"


def prepare_tokenizer(plan: Plan, blocks: list[tuple[int, int]], kept_bytes: int, run_tasks: Callable[..., list[Any]]) -> tuple[str, str]:
    """(absolute path of the tokenizer.json, the path the manifest records). Trains one when the config names
    none, on a deterministic sample of the kept text (about `sample_bytes`): one task per block takes its part
    (`sample_rows`), their files reach it through the exchange (`sample_exchange`), one task trains (`train_task`)."""
    tcfg = plan.cfg.tokenizer
    if tcfg.path is not None:
        return (tcfg.path if is_url(tcfg.path) else os.path.join(plan.cwd, tcfg.path)), tcfg.path
    if kept_bytes == 0:
        raise RuntimeError("no document survived curation: there is no text to train a tokenizer on")
    rate = min(1.0, tcfg.train.sample_bytes / kept_bytes)
    spec = sample_exchange(plan)
    names = [block_name(u, b) for u, b in blocks]
    parts = run_maps(run_tasks, spec, sample_rows, (plan, rate), [(name,) for name in names])
    sample_files = routed(run_tasks, spec, names, parts)
    sample_bytes = sum(p["text_bytes"] for p in parts)  # (the texts, not their compressed files)
    memory = task_memory(plan, "segment") + TRAIN_BYTES_PER_SAMPLE_BYTE * sample_bytes
    train = TrainTask(plan, sample_files)
    (trained,) = run_tasks(train_task, train, [()], "tokenizer train", record=_train_record, memory=memory)
    saved = plan.out / "tokenizer.json"
    if _sha256(saved) != trained["sha256"]:  # cut, changed or deleted since: trained again from the sample in work/
        record_location(_train_record, train).unlink()
        (again,) = run_tasks(train_task, train, [()], "tokenizer train", record=_train_record, memory=memory)
        if again["sha256"] != trained["sha256"]:  # never expected: training is deterministic
            raise DamagedWorkFile(saved, "it is not the tokenizer the work was tokenized with, and training again "
                                         "did not give that one back")
    if tcfg.train.save_dir:
        text = saved.read_text()
        target = Path(plan.cwd) / tcfg.train.save_dir / "tokenizer.json"
        if not target.exists() or target.read_text() != text:
            atomic_write_bytes(target, text.encode())
    return str(saved), "tokenizer.json"


def _sha256(path: Location) -> str | None:
    """The file's sha256, None when it is gone."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


_STAGE: dict[tuple[str, TokenizerConfig, str], TokenizeStage] = {}  # this worker process's one tokenizer


def _tokenize_stage(tokenizer_text: str, cfg: TokenizerConfig, tokenizer_path: str,
                    compiled: tuple[CompiledBPE | None, str] | None) -> TokenizeStage:
    """One tokenizer per worker process, built by its first tokenize task and reused by the next ones (Ray
    reuses a worker for the tasks of a phase: no actor processes to start, each of which would build it again)."""
    key = (tokenizer_text, cfg, tokenizer_path)
    if key not in _STAGE:
        _STAGE.clear()
        _STAGE[key] = TokenizeStage(tokenizer_text, cfg, tokenizer_path, compiled)
    return _STAGE[key]


@dataclass(frozen=True)
class TokenizeTask:
    """What the tokenize tasks share: the run's plan, the tokenizer (its path and text) and `try_compile`'s answer
    for that text (None under `encoder: tokenizers`)."""

    plan: Plan
    tokenizer_path: str
    tokenizer_text: str
    compiled: "tuple[CompiledBPE | None, str] | None"


def tokenize_phase(plan: Plan, blocks: list[tuple[int, int]], tokenizer_path: str) -> Phase:
    # the tokenizer's text travels with the phase (read once here), not read by every task (two requests a block),
    # and so does the fast encoder's proof, a function of that text alone: made once here, not in every worker
    text = location(tokenizer_path).read_text()
    compiled = try_compile(text) if plan.cfg.tokenizer.encoder != "tokenizers" else None
    task = TokenizeTask(plan, tokenizer_path, text, compiled)
    return Phase("tokenize", "tokenize", tokenize_task, task, blocks, tokenize_record_at, task_memory(plan, "tokenize"))


def tokenize_record_at(task: TokenizeTask, unit_index: int, block: int) -> Location:
    return task.plan.work / "tokens" / f"{block_name(unit_index, block)}.json"


def tokenize_task(task: TokenizeTask, unit_index: int, block: int) -> dict[str, Any]:
    """Encode one block's kept documents into its token file (and its lengths file, for shard planning)."""
    plan = task.plan
    name = block_name(unit_index, block)
    stage = _tokenize_stage(task.tokenizer_text, plan.cfg.tokenizer, task.tokenizer_path, task.compiled)
    table = block_documents(plan.work, plan.segments[-1].name, name)
    batches = [
        stage(b).append_column("lang", b.column("lang"))
        for b in table.to_batches(max_chunksize=plan.cfg.read.batch_size)
        if b.num_rows
    ]
    schema = shard_schema(stage.dtype)
    tokens = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    write_work_table(token_file(plan.work, name), tokens, compression=WORK_COMPRESSION)
    # the row lengths alone, for shard planning (`plan_shards`'s tasks): 8 bytes a row
    write_work_table(lengths_file(plan.work, name), tokens.select(["num_tokens"]))
    counters = Counters()
    input_index = plan.units[unit_index].input_index
    if tokens.num_rows:
        grouped = tokens.group_by("domain").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
        for row in grouped.to_pylist():
            counters.kept[(input_index, row["domain"])] = [row["num_tokens_count"], row["num_tokens_sum"]]
    return {"rows": tokens.num_rows, "counters": counters.to_json(), "encoder": stage.encoder}
