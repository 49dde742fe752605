"""The streaming loader: packed batches from curated shards, deterministic, resumable and rank-aware.

    from datapipe.loader import PackedLoader
    loader = PackedLoader("out/", seq_len=2048, batch_size=8, seed=0, epochs=1, num_workers=2)
    for batch in loader: ...   # input_ids, labels, position_ids, cu_seqlens, doc_ids, segment_ids (tensors)
    PackedLoader("scored/", ..., doc_columns=("ref_loss_mean",))   # + batch["ref_loss_mean"]: the document's value per token
    PackedLoader("scored/", ..., token_columns=("ref_loss",))   # + batch["ref_loss"]: each token's own value
    state = loader.state_dict(); loader.load_state_dict(state); loader.stats(); loader.report_losses(ids, losses)

The public loader and its worker fan-out; the parts each have a module of one job:
`reader` (shards opened and cached), `planner` (the document stream, domain interleaving and
packing into rows: read its docstring for the design), `feedback` (the loss reports and the
predictor and mixing bandit they train), `online_mixing` (the bandit) and `packing` (rows into the
training arrays). Argument errors raise `datapipe.core.config.ConfigError` naming the argument,
before any shard is read.

Workers. Planning a batch needs only document lengths, which are cheap; reading tokens and building
tensors is the costly part. So every DataLoader worker runs the same planner from the same state,
and worker w of W builds only the batches k with k % W == w (k counts batches since the state it
started from). torch's DataLoader takes worker outputs round-robin in order, so the batch sequence
is the same for any number of workers, 0 included (tested), and timing cannot reorder it. Each
batch travels with the planner state after it; `state_dict()` returns the state of the last
batch handed to the caller, whatever the workers have prefetched.

State. `state_dict()` is {version, config (the settings a resume must match), planner (see
`planner`), stats (what was served), losses, predictor and mixing (owned by `feedback`)}. Positions
count shuffle windows, units (documents, or chunks of long ones) and tokens, never batches or samples, so a state resumes the same rows with another batch size or number of workers. Resuming
reads the manifest, then only the shards of the pieces in the state, of the documents the next
batches draw, and (with world_size > 1) the one shard per domain that holds the rank's boundary.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import online_mixing as om
from datapipe.loader import prioritize as prio
from datapipe.loader.feedback import FEEDBACK_KEYS, LossFeedback
from datapipe.loader.packing import check_policy, compact_batch, expand_batch
from datapipe.loader.planner import PlanConfig, Planner
from datapipe.loader.reader import Layout, Reader, check_verify
from datapipe.loader.schedule import Curriculum, MixtureSchedule

STATE_VERSION = 4  # 2: ranks split long documents at chunk boundaries; 3: windows bounded by shuffle_shards;
# 4: windows shuffle units (a long split document's chunks), positions are (window, unit)
BATCH_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "doc_ids", "segment_ids")


def _batches(cfg: PlanConfig, layout: Layout, state: Mapping[str, Any], worker: int, num_workers: int,
             reader: Reader | None = None, dtype: Any = np.int64,
             doc_columns: Sequence[str] = (),
             token_columns: Sequence[str] = ()) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
    """Worker `worker` of `num_workers`: plan every batch from `state`, build every num_workers-th.
    `doc_columns`: shard columns whose per-segment values (the segment's document's) travel in meta;
    `token_columns`: per-token list columns, whose values of each piece's tokens travel in meta as (batch, seq_len)."""
    reader = reader or Reader(cfg.source, layout, cfg.cache_shards, verify=cfg.verify)
    planner = Planner(cfg, layout, reader)
    planner.load_state_dict(state)
    k = 0
    while True:
        rows = planner.next_rows()
        if rows is None:
            return
        if k % num_workers == worker:
            arrays = compact_batch(rows, reader.tokens, cfg.seq_len, batch_size=cfg.batch_size, pad_id=layout.eos_id,
                                   dtype=dtype)
            domain_tokens = [0] * len(layout.domains)
            for row in rows:
                for p in row:
                    domain_tokens[p.tag] += p.length
            meta = {"state": planner.state_dict(), "rows": len(rows), "domain_tokens": domain_tokens, "worker": worker}
            if doc_columns:
                meta["doc_columns"] = {name: _segment_values(reader, layout, arrays["seg_doc"], name)
                                       for name in doc_columns}
            if token_columns:
                meta["token_columns"] = {name: _piece_values(reader, rows, arrays["input_ids"].shape, name)
                                         for name in token_columns}
            yield arrays, meta
        k += 1


DOC_COLUMN_FIX = ("; a scoring pass adds such columns: `datapipe score` writes ref_loss (per token) and ref_loss_mean "
                  "(per document) (datapipe/train/reference.py), so run `datapipe score` first and train on its output "
                  "(a folder scored before ref_loss was per token must be scored again)")


def _segment_values(reader: Reader, layout: Layout, seg_doc: np.ndarray, name: str) -> np.ndarray:
    """Column `name` of each segment's document (float32; 0 for padding segments, doc -1)."""
    values = np.zeros(len(seg_doc), dtype=np.float32)
    for i, doc in enumerate(seg_doc.tolist()):
        if doc >= 0:
            s = layout.shard_of(doc)
            values[i] = reader.column(s, name, key="doc_columns", fix=DOC_COLUMN_FIX)[doc - int(layout.offsets[s])]
    return values


def _piece_values(reader: Reader, rows: Sequence[Sequence[Any]], shape: tuple[int, ...], name: str) -> np.ndarray:
    """Per-token column `name` of each row's pieces, placed as their tokens are (float32 (batch, seq_len); 0 on
    padding): the value at a token is the document's value at that token's position in the document."""
    values = np.zeros(shape, dtype=np.float32)
    for r, row in enumerate(rows):
        off = 0
        for p in row:
            values[r, off : off + p.length] = reader.token_values(p.doc, name, fix=DOC_COLUMN_FIX)[p.start : p.end]
            off += p.length
    return values


def _identity(sample: Any) -> Any:
    return sample


class _PackedDataset(torch.utils.data.IterableDataset):
    def __init__(self, cfg: PlanConfig, layout: Layout, state: Mapping[str, Any], doc_columns: Sequence[str] = (),
                 token_columns: Sequence[str] = ()) -> None:
        self.cfg, self.layout, self.state, self.doc_columns = cfg, layout, state, tuple(doc_columns)
        self.token_columns = tuple(token_columns)

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        # Workers send the compact batch (int32 tokens + one entry per segment) as numpy arrays, pickled
        # through the worker pipe; the main process expands it. DataLoader moves torch tensors through
        # one shared-memory file each, which cost 7x more per batch on this project's machine.
        return _batches(self.cfg, self.layout, self.state, worker, num_workers, dtype=self.layout.wire_dtype,
                        doc_columns=self.doc_columns, token_columns=self.token_columns)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"{name} must be an integer ≥ {low}, got {value!r}")
    return int(value)


def _check_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """This process's (rank, world_size): each one given is checked; one not given is torch.distributed's (0 and 1
    without it)."""
    if rank is None or world_size is None:
        dist_rank, dist_world = _dist_rank_world()
        rank = dist_rank if rank is None else rank
        world_size = dist_world if world_size is None else world_size
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
    return rank, world_size


def _check_layout(source: str, manifest: Mapping[str, Any], world_size: int) -> Layout:
    """The manifest's layout, which must hold documents, at least one per rank."""
    layout = Layout(manifest)
    if not layout.domains:
        raise ConfigError(f"source {source!r} holds no documents (manifest total_docs=0)")
    if int(manifest.get("total_docs", 0)) < world_size:
        raise ConfigError(f"world_size must be at most the manifest's total_docs="
                          f"{manifest.get('total_docs')!r} (every rank needs documents), got {world_size!r}")
    return layout


def _mixture_schedule(mixture: Any, online_mixing: Any, manifest: Mapping[str, Any],
                      domains: Sequence[str]) -> tuple[MixtureSchedule | None, om.OnlineMixing | None]:
    """The domain-weight schedule (None: the manifest's natural proportions, one pass per epoch) and the online
    mixing settings (None: off), checked against each other and the manifest's `domains`."""
    if mixture is None:
        schedule = None
    elif isinstance(mixture, MixtureSchedule):
        schedule = mixture
    elif isinstance(mixture, Mapping):
        schedule = MixtureSchedule.constant(mixture)
    else:
        raise ConfigError(f"mixture must be None, a mapping of domain weights or a MixtureSchedule, got {mixture!r}")
    mixing = om.OnlineMixing.from_value(online_mixing)
    if mixing is not None:
        if schedule is not None and len(schedule.phases) > 1:
            raise ConfigError(f"mixture must be constant (one phase) with online_mixing, which learns the weights "
                              f"and takes the mixture as its prior; got {len(schedule.phases)} phases")
        if schedule is None:  # the bandit's weights change: domains restart their passes on their own
            schedule = MixtureSchedule.natural(manifest)
    if schedule is not None:
        unknown = sorted(set(schedule.domains) - set(domains))
        if unknown:
            raise ConfigError(f"mixture names domains {unknown!r} that the manifest lacks; "
                              f"its domains are {list(domains)!r}")
    return schedule, mixing


def _long_doc_policies(long_docs: str | Mapping[str, str], domains: Sequence[str]) -> dict[str, str]:
    """Each domain's policy for documents longer than seq_len: one for all, or a mapping {domain or '*': policy}."""
    if isinstance(long_docs, str):
        check_policy("long_docs", long_docs)
        return {d: long_docs for d in domains}
    if isinstance(long_docs, Mapping):
        for key, value in long_docs.items():
            if key != "*" and key not in domains:
                raise ConfigError(f"long_docs key must be '*' or a domain of the manifest "
                                  f"{list(domains)!r}, got {key!r}")
            check_policy(f"long_docs[{key!r}]", value)
        default = long_docs.get("*", "split")
        return {d: long_docs.get(d, default) for d in domains}
    raise ConfigError(f"long_docs must be one of {{'split', 'truncate', 'drop'}} or a mapping, got {long_docs!r}")


class PackedLoader:
    """Packed, shuffled, rank- and worker-sharded training batches from a curated output folder.

    Iterating yields dicts of torch tensors: `input_ids`, `labels` (-100 where no loss applies),
    `position_ids`, `doc_ids` (-1 on padding), `segment_ids` (the attention segment of each token:
    one per packed piece, so two copies of a document in one row stay apart), all int64 of shape
    (batch_size, seq_len), and `cu_seqlens` (int32, the same segments' boundaries in the flattened
    batch, for variable-length attention). With `doc_columns`, also one float32 (batch_size, seq_len)
    tensor per named column: each token carries its document's value (0 on padding); with `token_columns`,
    the same for per-token list columns: each token carries its own value (0 on padding).
    Each `iter()` continues from the current state. The design: datapipe/loader/planner.py.

    Arguments:

        source: a curated output folder (local path or fsspec URL) holding `manifest.json`.
        seq_len, batch_size: row length in tokens and rows per batch.
        seed: the seed of every shuffle (integer ≥ 0).
        epochs: passes over the data (None: forever). With a mixture, an epoch is
            ceil(total_tokens / world_size) tokens on each rank.
        rank, world_size: this process's data-parallel rank; default from torch.distributed, else 0 and 1.
        num_workers: DataLoader worker processes (0: build batches in this process). The batches do not
            depend on it.
        mixture: domain weights, constant ({domain: weight}) or a `MixtureSchedule` over tokens consumed;
            None: the manifest's natural proportions, one pass per epoch.
        curriculum: order documents within each domain pass by a shard column, easy to hard.
        long_docs: what to do with documents longer than seq_len: 'split', 'truncate' or 'drop', or a
            mapping {domain or '*': policy}.
        shuffle, shuffle_window: shuffle shard order, and within windows of this many documents their
            units: a document, or each seq_len chunk of a longer one under 'split' (so a long document's
            chunks are spread among the window's other documents, not served back to back).
        shuffle_shards: the most shards one window draws from (a window ends early rather than touch
            more): each domain's window holds these shards open, so small shards are read once per pass.
        lookahead, max_open_bins: the packer's look-ahead buffer (pieces) and the bins kept open across it.
        loss_memory: the most documents whose reported loss is remembered (least recently reported go first).
        cache_shards: shards kept open per process besides those in use (the shuffle windows' shards and
            those of pieces waiting to be built, which stay open while needed).
        prefetch_factor: batches each worker prepares ahead.
        prioritize: loss-aware document selection (`datapipe.loader.prioritize.Prioritize`, a mapping of its fields,
            or True for the defaults); its predictor learns from `report_losses`. None: off.
        online_mixing: domain weights learnt during the run by an EXP3 bandit rewarded by each domain's
            reported loss (`datapipe.loader.online_mixing.OnlineMixing`, a mapping of its fields, or True for
            the defaults); `mixture` (one constant phase) or, without one, the manifest's token shares are
            its prior. Domains restart their passes on their own, as with a mixture. None: off.
        verify: check each shard when first opened, before any of its tokens is served: its size and
            sha256 against the manifest, its token ids below the tokenizer's vocab_size (a `ShardError`
            names a shard that fails, or is missing). True: a pass is remembered by the shard's size and
            modification time, so a shard is hashed once (bytes that rot in place with both kept are then
            served); 'always': hashed on every open; False: not checked (see datapipe/loader/reader.py).
        doc_columns: numeric per-document shard columns (e.g. `("ref_loss",)`, written by `datapipe score`) that
            batches carry as per-token float32 tensors under the column's name. They do not change which
            documents are served. A column the shards lack is a ConfigError (checked on the first shard here).
        token_columns: per-token shard columns, lists as long as each document's `tokens` (e.g. `("ref_loss",)`, each
            token's reference-model loss, written by `datapipe score`), carried as float32 tensors like `doc_columns`
            but with each token's own value: a piece [start, end) of a document gets the column's values
            [start, end) of that document. A column the first shard lacks, or that is not such a list, is a ConfigError.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        epochs: int | None = 1,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        mixture: MixtureSchedule | Mapping[str, float] | None = None,
        curriculum: Curriculum | None = None,
        long_docs: str | Mapping[str, str] = "split",
        shuffle: bool = True,
        shuffle_window: int = 8192,
        shuffle_shards: int = 16,
        lookahead: int = 512,
        max_open_bins: int = 16,
        loss_memory: int = 100_000,
        cache_shards: int = 16,
        prefetch_factor: int = 2,
        prioritize: prio.Prioritize | Mapping[str, Any] | bool | None = None,
        online_mixing: om.OnlineMixing | Mapping[str, Any] | bool | None = None,
        verify: bool | str = True,
        doc_columns: Sequence[str] = (),
        token_columns: Sequence[str] = (),
    ) -> None:
        """Checks every argument in turn, reads the manifest and sets up the parts (see the class docstring)."""
        seq_len = _check_int("seq_len", seq_len, 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        seed = _check_int("seed", seed, 0)
        if epochs is not None:
            epochs = _check_int("epochs", epochs, 1)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        shuffle_window = _check_int("shuffle_window", shuffle_window, 1)
        shuffle_shards = _check_int("shuffle_shards", shuffle_shards, 1)
        lookahead = _check_int("lookahead", lookahead, 1)
        max_open_bins = _check_int("max_open_bins", max_open_bins, 0)
        self.loss_memory = _check_int("loss_memory", loss_memory, 0)
        cache_shards = _check_int("cache_shards", cache_shards, 1)
        self.prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 1)
        if not isinstance(shuffle, bool):
            raise ConfigError(f"shuffle must be a bool, got {shuffle!r}")
        verify = check_verify(verify)
        rank, world_size = _check_rank(rank, world_size)
        if curriculum is not None and not isinstance(curriculum, Curriculum):
            raise ConfigError(f"curriculum must be a Curriculum or None, got {curriculum!r}")

        self.source = os.fspath(source) if isinstance(source, os.PathLike) else str(source)
        self.manifest = shards.read_manifest(self.source)
        layout = self._layout = _check_layout(self.source, self.manifest, world_size)
        schedule, mixing = _mixture_schedule(mixture, online_mixing, self.manifest, layout.domains)
        policies = _long_doc_policies(long_docs, layout.domains)
        self._cfg = PlanConfig(
            source=self.source, seq_len=seq_len, batch_size=batch_size, seed=seed, epochs=epochs, rank=rank,
            world_size=world_size, shuffle=shuffle, shuffle_window=shuffle_window, shuffle_shards=shuffle_shards,
            lookahead=lookahead, max_open_bins=max_open_bins, policies=policies, schedule=schedule, curriculum=curriculum,
            cache_shards=cache_shards, natural=MixtureSchedule.natural(self.manifest),
            prioritize=prio.Prioritize.from_value(prioritize), online_mixing=mixing, verify=verify,
        )
        self._reader = Reader(self.source, layout, cache_shards, verify=verify)
        self.doc_columns = self._check_doc_columns(doc_columns)
        self.token_columns = self._check_token_columns(token_columns)
        self._feedback = self._loss_feedback(schedule, mixing)
        self._planner_state = Planner(self._cfg, layout, self._reader).state_dict()
        self._stats = {"batches": 0, "rows": 0, "tokens": 0, "domain_tokens": {d: 0 for d in layout.domains}}

    def _loss_feedback(self, schedule: MixtureSchedule | None, mixing: om.OnlineMixing | None) -> LossFeedback:
        """The loss-feedback path: one object, its own lock (see datapipe/loader/feedback.py). With online mixing, the
        schedule's first weights are the bandit's prior."""
        layout = self._layout
        prior = schedule.weights_at(0) if mixing else None
        return LossFeedback(
            self.loss_memory, self._cfg.prioritize,
            (lambda docs: self._reader.features(docs, self._cfg.prioritize)) if self._cfg.prioritize else None,
            online_mixing=mixing, mixing_prior={d: prior.get(d, 0.0) for d in layout.domains} if mixing else None,
            domains=(lambda docs: om.doc_domains(layout, self._reader, docs)) if mixing else None)

    def _check_doc_columns(self, doc_columns: Sequence[str]) -> tuple[str, ...]:
        if isinstance(doc_columns, str) or not isinstance(doc_columns, Sequence) \
                or not all(isinstance(c, str) and c for c in doc_columns):
            raise ConfigError(f"doc_columns must be a sequence of column names, e.g. ('ref_loss',), got {doc_columns!r}")
        reserved = sorted(set(doc_columns) & {"id", "domain", "tokens", "lang", *BATCH_KEYS})
        if reserved:
            raise ConfigError(f"doc_columns must name numeric document columns, got {reserved[0]!r}")
        for name in doc_columns:  # the first shard holds it and it is numeric (later shards: when first read)
            try:
                self._reader.column(0, name, key="doc_columns", fix=DOC_COLUMN_FIX)
            except ConfigError:
                raise
            except (ValueError, TypeError) as exc:  # a string column: not convertible to float
                raise ConfigError(f"doc_columns must name numeric columns; column {name!r} of "
                                  f"{self._layout.paths[0]} is not ({exc})") from None
        return tuple(doc_columns)

    def _check_token_columns(self, token_columns: Sequence[str]) -> tuple[str, ...]:
        if isinstance(token_columns, str) or not isinstance(token_columns, Sequence) \
                or not all(isinstance(c, str) and c for c in token_columns):
            raise ConfigError(f"token_columns must be a sequence of column names, e.g. ('ref_loss',), got {token_columns!r}")
        reserved = sorted((set(token_columns) & {"id", "domain", "tokens", "lang", *BATCH_KEYS})
                          | (set(token_columns) & set(self.doc_columns)))
        if reserved:
            raise ConfigError(f"token_columns must name per-token numeric columns (not in doc_columns), got {reserved[0]!r}")
        for name in token_columns:  # the first shard holds it as lists as long as the documents (later: when read)
            self._reader.token_column(0, name, fix=DOC_COLUMN_FIX)
        return tuple(token_columns)

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        pcfg, mcfg = self._cfg.prioritize, self._cfg.online_mixing
        while True:
            # prioritization / online mixing: every `refresh` served batches the planner gets the live predictor
            # / bandit policy, and the batch source restarts from the current state (the planner is a pure
            # function of its state)
            b = self._stats["batches"]
            if pcfg and b % pcfg.refresh == 0:
                self._planner_state = {**self._planner_state, "predictor": self._feedback.snapshot(until=b - pcfg.lag)}
            if mcfg and b % mcfg.refresh == 0:
                self._planner_state = {**self._planner_state,
                                       "mixing": self._feedback.mixing_snapshot(until=b - mcfg.lag)}
            served = 0
            for batch in self._iter_source():
                yield batch
                served += 1
                b = self._stats["batches"]
                if (pcfg and b % pcfg.refresh == 0) or (mcfg and b % mcfg.refresh == 0):
                    break
            else:
                return
            if not served:
                return

    def _iter_source(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.num_workers == 0:
            source = _batches(self._cfg, self._layout, self._planner_state, 0, 1, self._reader,
                              doc_columns=self.doc_columns, token_columns=self.token_columns)
        else:
            source = iter(torch.utils.data.DataLoader(
                _PackedDataset(self._cfg, self._layout, self._planner_state, self.doc_columns, self.token_columns),
                batch_size=None,
                num_workers=self.num_workers, collate_fn=_identity, prefetch_factor=self.prefetch_factor,
            ))
        try:
            for arrays, meta in source:
                full = expand_batch(**arrays)
                batch = {key: torch.from_numpy(full[key]) for key in BATCH_KEYS}
                for name, values in meta.get("doc_columns", {}).items():  # per segment -> per token
                    batch[name] = torch.from_numpy(np.repeat(values, arrays["seg_len"]).reshape(full["input_ids"].shape))
                for name, values in meta.get("token_columns", {}).items():
                    batch[name] = torch.from_numpy(values)
                self._planner_state = meta["state"]
                st = self._stats
                st["batches"] += 1
                st["rows"] += meta["rows"]
                for d, n in zip(self._layout.domains, meta["domain_tokens"]):
                    st["domain_tokens"][d] += n
                    st["tokens"] += n
                yield batch
        finally:
            # The DataLoader's workers stopped now, as its iterator's __del__ would: after an error (a ShardError)
            # the exception's traceback keeps the iterator alive, the garbage collector then finalizes its queues
            # before that __del__ runs, the workers never get the stop message, and each is joined for 5 s (10 s
            # with 2 workers). torch has no public close for it.
            stop_workers = getattr(source, "_shutdown_workers", None)
            if stop_workers is not None:
                stop_workers()

    @property
    def epoch(self) -> int:
        """The epoch of the next document to be drawn."""
        return int(self._planner_state["epoch"])

    @property
    def domains(self) -> tuple[str, ...]:
        """The manifest's domains that hold documents, sorted: what `doc_domains` indexes."""
        return self._layout.domains

    def doc_domains(self, doc_ids: Sequence[int] | torch.Tensor | np.ndarray) -> np.ndarray:
        """The index in `domains` of each document id's domain, in the shape of `doc_ids` (-1 for padding, ids < 0).
        Reads the domain column of mixed shards only (cached with the shard)."""
        ids = np.asarray(doc_ids.cpu() if isinstance(doc_ids, torch.Tensor) else doc_ids, dtype=np.int64)
        unique, inverse = np.unique(ids, return_inverse=True)
        return om.doc_domains(self._layout, self._reader, unique)[inverse].reshape(ids.shape)

    # -- state -------------------------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        """Where the loader stands after the last batch served, without the feedback state: what a
        prefetcher captures per batch (cheap), to be completed by `state_dict(position=...)`."""
        return {
            "version": STATE_VERSION,
            "config": self._cfg.fingerprint(self._layout),
            "planner": copy.deepcopy(self._planner_state),
            "stats": {**self._stats, "domain_tokens": dict(self._stats["domain_tokens"])},
        }

    def state_dict(self, position: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A JSON-serialisable state: a loader given it continues with the next batch, bitwise.

        position: a state returned earlier by `position()` or `state_dict()` (a prefetcher captures
        one per batch): the result is that position with the live feedback state (reported losses,
        loss predictor), taken under the feedback's own lock. Safe to call from another thread than
        the one iterating. None: the position of the last batch served.
        """
        if position is None:
            position = self.position()
        elif not isinstance(position, Mapping) or position.get("version") != STATE_VERSION:
            got = position.get("version") if isinstance(position, Mapping) else position
            raise ConfigError(f"position must be a state from state_dict() or position() (version {STATE_VERSION}), "
                              f"got version {got!r}")
        return {**{k: v for k, v in position.items() if k not in FEEDBACK_KEYS}, **self._feedback.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else state
            old = {1: " (a state of version 1 was written before ranks were balanced by tokens: the same position "
                      "now holds other documents, so it cannot resume exactly; start the data from the beginning)",
                   2: " (a state of version 2 was written before shuffle windows were bounded by shuffle_shards: on "
                      "small shards the same position now holds other documents, so it cannot resume exactly; start "
                      "the data from the beginning)",
                   3: " (a state of version 3 was written before a long document's chunks were shuffled among the "
                      "window's other documents: its positions count documents, not units, so it cannot resume "
                      "exactly; start the data from the beginning)"}.get(got, "")
            raise ConfigError(f"state['version'] must be {STATE_VERSION}, got {got!r}{old}")
        ours = self._cfg.fingerprint(self._layout)
        theirs = state.get("config", {})
        for key, value in ours.items():
            if theirs.get(key) != value:
                raise ConfigError(f"state['config'][{key!r}] is {theirs.get(key)!r} but this loader has {value!r}; "
                                  "build the loader with the settings of the saved run to resume it exactly")
        planner = Planner(self._cfg, self._layout, self._reader)
        planner.load_state_dict(state["planner"])  # validates the shape before anything changes
        self._planner_state = planner.state_dict()
        stats = state["stats"]
        self._stats = {"batches": int(stats["batches"]), "rows": int(stats["rows"]), "tokens": int(stats["tokens"]),
                       "domain_tokens": {d: int(stats["domain_tokens"].get(d, 0)) for d in self._layout.domains}}
        self._feedback.load_state_dict(state)

    # -- observability and feedback ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What has been served so far (this rank): tokens, packing efficiency, per-domain shares."""
        st, plan = self._stats, self._planner_state
        schedule = self._cfg.schedule or self._cfg.natural
        tokens = st["tokens"]
        slots = st["batches"] * self._cfg.batch_size * self._cfg.seq_len
        row_slots = st["rows"] * self._cfg.seq_len
        return {
            "epoch": int(plan["epoch"]),
            "batches": st["batches"],
            "rows": st["rows"],
            "tokens": tokens,
            "slots": slots,
            "packing_efficiency": tokens / row_slots if row_slots else 0.0,  # real tokens / tokens of the rows served
            "batch_fill": tokens / slots if slots else 0.0,  # also counts padding rows of a last batch
            "domain_tokens": dict(st["domain_tokens"]),
            "domain_shares": {d: (n / tokens if tokens else 0.0) for d, n in st["domain_tokens"].items()},
            # at the current position (with online mixing: the policy in use)
            "weights": plan.get("mixing") or schedule.weights_at(plan["tokens_drawn"] * self._cfg.world_size),
            "tokens_drawn": int(plan["tokens_drawn"]),
            **plan["counters"],
            "losses_remembered": self._feedback.remembered(),
        }

    def report_losses(self, doc_ids: Sequence[int] | torch.Tensor | np.ndarray,
                      losses: Sequence[float] | torch.Tensor | np.ndarray) -> None:
        """Remember per-document losses from the trainer (mean per document per call, then an EMA, 0.9 decay).

        Memory is bounded by `loss_memory` documents (the least recently reported are forgotten).
        Ids < 0 (padding) are ignored. The losses are part of the state. With `prioritize`, each call also
        trains the loss predictor on the documents' static features and this call's mean losses; with
        `online_mixing`, each call is one round of the bandit (per-domain mean of this call's document losses).
        Thread-safe on its own: the feedback object holds its own lock, callers need none.
        """
        self._feedback.report(doc_ids, losses)

    def losses(self) -> dict[int, float]:
        """The remembered loss of each reported document."""
        return self._feedback.losses()


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
