"""The streaming loader: packed batches from curated shards, deterministic, resumable and rank-aware.

    from datapipe.loader import PackedLoader
    loader = PackedLoader("out/", seq_len=2048, batch_size=8, seed=0, epochs=1, num_workers=2)
    for batch in loader: ...   # input_ids, labels, position_ids, cu_seqlens, doc_ids (torch tensors)
    state = loader.state_dict(); loader.load_state_dict(state); loader.stats(); loader.report_losses(ids, losses)

The document stream is a pure function of (seed, rank, world_size, position):
- **Pass p of domain d.** The shards that hold domain d, in an order permuted by (seed, p). Their
  documents of domain d, in that order, are cut into `world_size` contiguous ranges of equal
  token count (to within one document), one per rank, so every rank holds every domain in the same
  proportion and the ranks' batch counts stay within about one of each other. The rank's range is
  cut into windows of `shuffle_window` documents, each permuted by (seed, p, rank, d, window): a
  bounded shuffle whose position is one integer, not a buffer. With a `Curriculum`, the whole range
  is instead ordered by the score column (ties in shuffled order).
- **Domains interleave** by `schedule.DeficitSampler` at the schedule's weights for the tokens
  consumed so far (this rank's tokens × world_size, an estimate of the global count that does not
  depend on batch size or world size). The curated shards are cut in input order, so one shard
  usually holds one domain: interleaving per domain keeps the mixture steady through an epoch,
  which shuffling shards alone would not.
- **Epochs.** With `mixture=None` the weights are the manifest's token totals and every domain
  makes exactly one pass per epoch; the epoch ends when every domain is exhausted, so over an
  epoch every token of the rank's part is served exactly once, and the ranks' parts partition the
  manifest. With a `mixture`, each domain restarts its next pass (a fresh permutation) whenever it
  runs out, and an epoch is `ceil(total_tokens / world_size)` tokens drawn on the rank.
- **Prioritization** (optional, `datapipe.prioritize`): the domain's documents are drawn a pool at
  a time and only some are kept, sampled by predicted loss under a floor; the others are skipped in
  this pass. The pools waiting and the predictor snapshot are part of the planner state.
- **Packing** (`packing.BFDPacker`) packs the drawn documents into rows; it is flushed at each
  epoch end, so no row mixes two epochs. Rows are grouped `batch_size` at a time; only the very
  last batch of a finite run can hold padding rows.

Workers. Planning a batch needs only document lengths, which are cheap; reading tokens and building
tensors is the costly part. So every DataLoader worker runs the same planner from the same state,
and worker w of W builds only the batches k with k % W == w (k counts batches since the state it
started from). torch's DataLoader takes worker outputs round-robin in order, so the batch sequence
is the same for any number of workers, 0 included (tested), and timing cannot reorder it. Each
batch travels with the planner state after it; `state_dict()` returns the state of the last
batch handed to the caller, whatever the workers have prefetched.

State. Every random choice is drawn from a generator keyed by (seed, pass, rank, domain, window):
there is no RNG state to carry. The state is: the epoch, tokens drawn, per-domain (pass,
position, done), the sampler's credit and served tokens, the packer's buffered pieces and open
bins, the rows planned but not yet batched (pieces as [doc, start, end, doc_len, domain, seq]),
counters, and the reported losses. Positions count documents and tokens, never batches or
samples, so a state resumes the same rows with another batch size or number of workers. Resuming
reads the manifest, then only the shards of the pieces in the state, of the documents the next
batches draw, and (with world_size > 1) the one shard per domain that holds the rank's boundary.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch

from datapipe.core import shards
from datapipe.loader import prioritize as prio
from datapipe.loader.packing import BFDPacker, Piece, Row, check_policy, compact_batch, expand_batch, split_document
from datapipe.loader.schedule import Curriculum, DeficitSampler, MixtureSchedule

STATE_VERSION = 1
_TAG_SHARDS, _TAG_WINDOW, _TAG_PRIO = 1, 2, 3
BATCH_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "doc_ids")


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


class _Layout:
    """What the manifest says, arranged for planning: no shard is opened here."""

    def __init__(self, manifest: Mapping[str, Any]) -> None:
        infos = manifest["shards"]
        self.paths = [s["path"] for s in infos]
        rows = np.array([int(s["rows"]) for s in infos], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # global doc id of each shard's row 0
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


class _ShardData:
    __slots__ = ("table", "offsets", "values", "lengths", "domain_rows", "columns")

    def __init__(self, table: Any) -> None:
        self.table = table
        tokens = table.column("tokens").combine_chunks()
        self.offsets = tokens.offsets.to_numpy().astype(np.int64)
        self.values = tokens.values.to_numpy(zero_copy_only=False)
        self.lengths = table.column("num_tokens").to_numpy()
        self.domain_rows: dict[str, np.ndarray] = {}
        self.columns: dict[str, np.ndarray] = {}


class _Reader:
    """Shards opened through `datapipe.shards`, kept in a small LRU (local shards are memory-mapped)."""

    def __init__(self, source: str, layout: _Layout, cache_shards: int) -> None:
        self.source = source
        self.layout = layout
        self.cache_shards = cache_shards
        self._cache: OrderedDict[int, _ShardData] = OrderedDict()

    def _shard(self, s: int) -> _ShardData:
        data = self._cache.get(s)
        if data is None:
            data = _ShardData(shards.open_shard(self.source, self.layout.paths[s]))
            self._cache[s] = data
            while len(self._cache) > self.cache_shards:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(s)
        return data

    def domain_rows(self, s: int, domain: str) -> np.ndarray:
        """The rows of shard s that belong to `domain`, ascending."""
        if self.layout.single_domain[s]:  # the manifest says so: no read needed
            return np.arange(int(self.layout.domain_docs[domain][s]), dtype=np.int64)
        return self._domain_rows(self._shard(s), domain)

    def _domain_rows(self, data: _ShardData, domain: str) -> np.ndarray:
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

    def column(self, s: int, name: str) -> np.ndarray:
        data = self._shard(s)
        col = data.columns.get(name)
        if col is None:
            if name not in data.table.column_names:
                raise ValueError(
                    f"curriculum.column must name a column of the shards, got {name!r}; "
                    f"{self.layout.paths[s]} has {data.table.column_names!r}")
            col = data.columns[name] = data.table.column(name).to_numpy().astype(np.float64)
        return col

    def features(self, docs: Sequence[int], cfg: prio.Prioritize) -> np.ndarray:
        """The static features (prioritize.FEATURES) of documents, one row each; opens their shards."""
        table = getattr(self, "_ref", None)
        if table is None:
            vocab = self._vocab_size()
            arrays = (self._shard(s).values for s in range(len(self.layout.paths)))
            table = self._ref = prio.reference_log_freq(arrays, cfg.ref_tokens, vocab)
        return np.stack([prio.features(self.tokens(int(d)), table[0], table[1], cfg.rare_count) for d in docs]) \
            if len(docs) else np.zeros((0, len(prio.FEATURES)))

    def _vocab_size(self) -> int | None:
        v = getattr(self.layout, "vocab_size", None)
        return v if isinstance(v, int) and v <= 1 << 22 else None

    def tokens(self, doc: int) -> np.ndarray:
        s = int(np.searchsorted(self.layout.offsets, doc, side="right")) - 1
        data = self._shard(s)
        row = doc - int(self.layout.offsets[s])
        return data.values[data.offsets[row] : data.offsets[row + 1]]


@dataclass(frozen=True)
class _Config:
    """Everything that decides the batch sequence (and nothing that does not: workers, cache)."""

    source: str
    seq_len: int
    batch_size: int
    seed: int
    epochs: int | None
    rank: int
    world_size: int
    shuffle: bool
    shuffle_window: int
    lookahead: int
    max_open_bins: int
    policies: dict[str, str]
    schedule: MixtureSchedule | None  # None: epoch mode, natural weights
    curriculum: Curriculum | None
    cache_shards: int
    natural: MixtureSchedule  # the manifest's token shares: the weights when schedule is None
    prioritize: prio.Prioritize | None = None  # loss-aware document selection (datapipe/prioritize.py)

    def fingerprint(self, layout: _Layout) -> dict[str, Any]:
        """The settings a state must match to resume exactly (batch size and workers may change)."""
        return {
            "manifest": layout.fingerprint,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "lookahead": self.lookahead,
            "max_open_bins": self.max_open_bins,
            "long_docs": dict(sorted(self.policies.items())),
            "mixture": self.schedule.to_dict() if self.schedule else None,
            "curriculum": self.curriculum.to_dict() if self.curriculum else None,
            **({"prioritize": self.prioritize.to_dict()} if self.prioritize else {}),
        }


class _DomainStream:
    """This rank's documents of one domain in one pass: `doc(k)` is the k-th, (doc id, length).

    Window w holds positions [w * window, (w + 1) * window) of the rank's range; position k draws
    the window's document perm[k mod window]. The permutation needs only the manifest's counts,
    so a document's shard is opened only when that document is drawn (a resumed loader opens no
    shard of the window it does not draw from). A curriculum needs every score of the range at once.
    """

    def __init__(self, cfg: _Config, layout: _Layout, reader: _Reader, domain: str, pass_: int) -> None:
        self.cfg, self.layout, self.reader = cfg, layout, reader
        self.domain, self.pass_ = domain, pass_
        self.d_idx = layout.domains.index(domain)
        counts = layout.domain_docs[domain]
        order = np.arange(len(counts))
        if cfg.shuffle:
            order = _rng(cfg.seed, _TAG_SHARDS, pass_).permutation(len(counts))
        self.order = order[counts[order] > 0]
        self.starts = np.concatenate([[0], np.cumsum(counts[self.order])])  # first document of each shard
        self.tstarts = np.concatenate([[0], np.cumsum(layout.domain_tokens[domain][self.order])])  # first token
        self.lo = self._boundary(cfg.rank)
        self.n = self._boundary(cfg.rank + 1) - self.lo
        self.window = max(self.n, 1) if cfg.curriculum else cfg.shuffle_window
        self._w = -1
        self._perm = np.zeros(0, dtype=np.int64)
        self._ids = self._lens = None

    def _boundary(self, r: int) -> int:
        """The first document of rank r: ranks split the domain's tokens evenly, to within a document.

        Document j belongs to the rank whose token range [D*r/W, D*(r+1)/W) holds its first
        token. Splitting by tokens rather than documents keeps the ranks' batch counts within about
        one of each other (splitting by documents left them 15% apart on the shared corpus, whose
        shards range from 700 to 5,000 tokens a document). The manifest's per-shard token counts
        place the boundary in one shard, whose lengths are then read: at most one shard per boundary.
        """
        world = self.cfg.world_size
        if r <= 0:
            return 0
        if r >= world:
            return int(self.starts[-1])
        t = int(self.tstarts[-1]) * r  # document j is before the boundary when offset_j * world < t
        i = int(np.searchsorted(self.tstarts[:-1] * world, t, side="left")) - 1  # last shard starting before it
        if int(self.tstarts[i + 1]) * world <= t:
            return int(self.starts[i + 1])
        s = int(self.order[i])
        lens = self.reader.lengths(s)[self.reader.domain_rows(s, self.domain)].astype(np.int64)
        offsets = int(self.tstarts[i]) + np.concatenate([[0], np.cumsum(lens)[:-1]])
        return int(self.starts[i]) + int(np.count_nonzero(offsets * world < t))

    def doc(self, k: int) -> tuple[int, int]:
        w = k // self.window
        if w != self._w:
            self._load_window(w)
        i = k - w * self.window
        if self._ids is not None:
            return int(self._ids[i]), int(self._lens[i])
        return self._locate(self.lo + w * self.window + int(self._perm[i]))

    def _locate(self, c: int) -> tuple[int, int]:
        """Position c of the domain's concatenation: (global doc id, length); opens its shard."""
        i = int(np.searchsorted(self.starts, c, side="right")) - 1
        s = int(self.order[i])
        row = self.reader.domain_row(s, self.domain, c - int(self.starts[i]))
        return int(self.layout.offsets[s]) + row, int(self.reader.lengths(s)[row])

    def _load_window(self, w: int) -> None:
        size = min(self.window, self.n - w * self.window)
        perm = np.arange(size)
        if self.cfg.shuffle:
            perm = _rng(self.cfg.seed, _TAG_WINDOW, self.pass_, self.cfg.rank, self.d_idx, w).permutation(size)
        self._perm, self._w = perm, w
        if self.cfg.curriculum:  # order the whole range by score; ties keep the shuffled order
            ids, lens, scores = [], [], []
            a, b = self.lo, self.lo + self.n
            i = int(np.searchsorted(self.starts, a, side="right")) - 1
            while a < b:
                s = int(self.order[i])
                x, y = a - int(self.starts[i]), min(b, int(self.starts[i + 1])) - int(self.starts[i])
                rows = self.reader.domain_rows(s, self.domain)[x:y]
                ids.append(self.layout.offsets[s] + rows)
                lens.append(self.reader.lengths(s)[rows].astype(np.int64))
                scores.append(self.reader.column(s, self.cfg.curriculum.column)[rows])
                a += y - x
                i += 1
            sc = np.concatenate(scores)[perm]
            order = perm[np.argsort(-sc if self.cfg.curriculum.descending else sc, kind="stable")]
            self._ids, self._lens = np.concatenate(ids)[order], np.concatenate(lens)[order]


class _Planner:
    """Decides which pieces of which documents fill each row; needs lengths only, never tokens."""

    def __init__(self, cfg: _Config, layout: _Layout, reader: _Reader) -> None:
        self.cfg, self.layout, self.reader = cfg, layout, reader
        self.domains = layout.domains
        self.packer = BFDPacker(cfg.seq_len, lookahead=cfg.lookahead, max_open_bins=cfg.max_open_bins)
        self.sampler = DeficitSampler(self.domains)
        self.schedule = cfg.schedule or cfg.natural
        self.epoch_target = math.ceil(layout.total_tokens / cfg.world_size)
        self.epoch = 0
        self.tokens_drawn = 0
        self.epoch_tokens = 0
        self.next_seq = 0
        self.passes = {d: 0 for d in self.domains}
        self.pos = {d: 0 for d in self.domains}
        self.done = {d: False for d in self.domains}
        self.excluded: set[str] = set()  # mixture mode: domains this rank never gets a document of
        self.pending: list[Row] = []
        self.counters = {"docs_drawn": 0, "docs_split": 0, "docs_truncated": 0, "docs_dropped": 0, "tokens_dropped": 0}
        self._streams: dict[str, _DomainStream] = {}
        # prioritization: kept documents waiting per domain ([doc, len]) and the predictor snapshot in use
        self.queues: dict[str, list[list[int]]] = {d: [] for d in self.domains}
        self.predictor: dict[str, Any] | None = None
        if cfg.prioritize:
            self.counters["docs_skipped"] = 0

    @property
    def finished(self) -> bool:
        return self.cfg.epochs is not None and self.epoch >= self.cfg.epochs

    def _epoch_over(self) -> bool:
        if self.cfg.schedule is None:
            return all(self.done.values())
        return self.epoch_tokens >= self.epoch_target

    def _stream(self, d: str) -> _DomainStream:
        st = self._streams.get(d)
        if st is None or st.pass_ != self.passes[d]:
            st = self._streams[d] = _DomainStream(self.cfg, self.layout, self.reader, d, self.passes[d])
        return st

    def weights(self) -> dict[str, float]:
        return self.schedule.weights_at(self.tokens_drawn * self.cfg.world_size)

    def _advance(self) -> None:
        """Draw one document into the packer, or close the epoch."""
        cfg = self.cfg
        if self._epoch_over():
            self.pending += self.packer.flush()
            self.epoch += 1
            self.epoch_tokens = 0
            if cfg.schedule is None:  # epoch mode: every domain starts its next pass together
                self.passes = {d: self.epoch for d in self.domains}
                self.pos = {d: 0 for d in self.domains}
                self.done = {d: False for d in self.domains}
                self.sampler.reset()
            return
        weights = self.weights()
        empty_passes = dict.fromkeys(self.domains, 0)
        while True:
            eligible = [d for d in self.domains if not self.done[d] and d not in self.excluded]
            d = self.sampler.choose(weights, eligible)
            if d is None:
                raise ValueError(
                    f"mixture weights {weights!r} at {self.tokens_drawn * cfg.world_size} tokens select no domain "
                    f"with documents on rank {cfg.rank} of {cfg.world_size}; domains with documents here: {eligible!r}")
            stream = self._stream(d)
            if stream.n > 0:
                break
            # this rank holds no document of d in this pass (a domain of fewer documents than ranks)
            if cfg.schedule is None:
                self.done[d] = True
                if self._epoch_over():
                    return
            else:
                self.passes[d] += 1
                empty_passes[d] += 1
                if empty_passes[d] >= 16:  # no pass gives this rank a document of d: leave d to the others
                    self.excluded.add(d)
        if cfg.prioritize:
            doc, n = self._draw_prioritized(d)
        else:
            doc, n = stream.doc(self.pos[d])
            self.pos[d] += 1
            if self.pos[d] >= stream.n:
                if cfg.schedule is None:
                    self.done[d] = True
                else:  # mixture mode: the domain starts its next pass on its own
                    self.passes[d] += 1
                    self.pos[d] = 0
        policy = cfg.policies[d]
        pieces = split_document(doc, n, cfg.seq_len, policy, tag=stream.d_idx, seq=self.next_seq)
        self.next_seq += 1
        kept = sum(p.length for p in pieces)
        c = self.counters
        c["docs_drawn"] += 1
        if n > cfg.seq_len:
            c[{"split": "docs_split", "truncate": "docs_truncated", "drop": "docs_dropped"}[policy]] += 1
            c["tokens_dropped"] += n - kept
        self.sampler.record(d, kept, weights, eligible)
        self.tokens_drawn += kept
        self.epoch_tokens += kept
        for p in pieces:
            self.pending += self.packer.push(p)

    def _draw_prioritized(self, d: str) -> tuple[int, int]:
        """The next kept document of domain d: refill a pool from the stream, keep some by predicted loss."""
        cfg, pcfg, queue = self.cfg, self.cfg.prioritize, self.queues[d]
        if not queue:
            pool: list[list[int]] = []
            while len(pool) < pcfg.pool:
                st = self._stream(d)
                if st.n == 0 or (cfg.schedule is None and self.pos[d] >= st.n):
                    break
                pool.append(list(st.doc(self.pos[d])))
                self.pos[d] += 1
                if self.pos[d] >= st.n and cfg.schedule is not None:  # mixture mode: next pass on its own
                    self.passes[d] += 1
                    self.pos[d] = 0
            keep = max(1, round(pcfg.keep * len(pool)))
            pred = None
            if self.predictor is not None:
                pred = prio.predict(self.predictor, self.reader.features([doc for doc, _ in pool], pcfg))
            rng = _rng(cfg.seed, _TAG_PRIO, cfg.rank, self.layout.domains.index(d), self.next_seq)
            queue.extend(pool[i] for i in prio.select(len(pool), pred, keep, pcfg, rng))
            self.counters["docs_skipped"] += len(pool) - keep
        doc, n = queue.pop(0)
        if cfg.schedule is None and not queue and self.pos[d] >= self._stream(d).n:
            self.done[d] = True
        return int(doc), int(n)

    def next_rows(self) -> list[Row] | None:
        """The rows of the next batch (fewer than batch_size only at the very end), or None."""
        bs = self.cfg.batch_size
        first_epoch = self.epoch
        while len(self.pending) < bs and not self.finished:
            self._advance()
            if self.epoch > first_epoch + 2 and not self.pending:  # whole epochs without a document
                raise ValueError(f"rank {self.cfg.rank} of world_size={self.cfg.world_size} gets no documents "
                                 f"from this manifest; use a smaller world_size")
        if not self.pending:
            return None
        rows, self.pending = self.pending[:bs], self.pending[bs:]
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "tokens_drawn": self.tokens_drawn,
            "epoch_tokens": self.epoch_tokens,
            "next_seq": self.next_seq,
            "domains": {d: [self.passes[d], self.pos[d], self.done[d]] for d in self.domains},
            "excluded": sorted(self.excluded),
            "sampler": self.sampler.state_dict(),
            "packer": self.packer.state_dict(),
            "pending": [[p.to_list() for p in row] for row in self.pending],
            "counters": dict(self.counters),
            **({"queues": {d: [list(x) for x in q] for d, q in self.queues.items()},
                "predictor": copy.deepcopy(self.predictor)} if self.cfg.prioritize else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.tokens_drawn = int(state["tokens_drawn"])
        self.epoch_tokens = int(state["epoch_tokens"])
        self.next_seq = int(state["next_seq"])
        for d in self.domains:
            p, k, done = state["domains"][d]
            self.passes[d], self.pos[d], self.done[d] = int(p), int(k), bool(done)
        self.excluded = set(state["excluded"])
        self.sampler.load_state_dict(state["sampler"])
        self.packer.load_state_dict(state["packer"])
        self.pending = [[Piece.from_list(p) for p in row] for row in state["pending"]]
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        self._streams = {}
        if self.cfg.prioritize:
            self.queues = {d: [[int(a), int(b)] for a, b in state["queues"].get(d, [])] for d in self.domains}
            self.predictor = copy.deepcopy(state.get("predictor"))


def _batches(cfg: _Config, layout: _Layout, state: Mapping[str, Any], worker: int, num_workers: int,
             reader: _Reader | None = None, dtype: Any = np.int64) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
    """Worker `worker` of `num_workers`: plan every batch from `state`, build every num_workers-th."""
    reader = reader or _Reader(cfg.source, layout, cfg.cache_shards)
    planner = _Planner(cfg, layout, reader)
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
            yield arrays, meta
        k += 1


def _identity(sample: Any) -> Any:
    return sample


class _PackedDataset(torch.utils.data.IterableDataset):
    def __init__(self, cfg: _Config, layout: _Layout, state: Mapping[str, Any]) -> None:
        self.cfg, self.layout, self.state = cfg, layout, state

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        # Workers send the compact batch (int32 tokens + one entry per segment) as numpy arrays, pickled
        # through the worker pipe; the main process expands it. DataLoader moves torch tensors through
        # one shared-memory file each, which cost 7x more per batch on this project's machine.
        return _batches(self.cfg, self.layout, self.state, worker, num_workers, dtype=self.layout.wire_dtype)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer ≥ {low}, got {value!r}")
    return int(value)


class PackedLoader:
    """Packed, shuffled, rank- and worker-sharded training batches from a curated output folder.

    Iterating yields dicts of torch tensors: `input_ids`, `labels` (-100 where no loss applies),
    `position_ids`, `doc_ids` (-1 on padding), all int64 of shape (batch_size, seq_len), and
    `cu_seqlens` (int32, segment boundaries of the flattened batch for variable-length attention).
    Each `iter()` continues from the current state. See the module docstring for the design.
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
        lookahead: int = 512,
        max_open_bins: int = 16,
        loss_memory: int = 100_000,
        cache_shards: int = 16,
        prefetch_factor: int = 2,
        prioritize: prio.Prioritize | Mapping[str, Any] | bool | None = None,
    ) -> None:
        """
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
        shuffle, shuffle_window: shuffle shard order and documents within windows of this many documents.
        lookahead, max_open_bins: the packer's look-ahead buffer (pieces) and the bins kept open across it.
        loss_memory: the most documents whose reported loss is remembered (least recently reported go first).
        cache_shards: shards kept open per process.
        prefetch_factor: batches each worker prepares ahead.
        prioritize: loss-aware document selection (`datapipe.prioritize.Prioritize`, a mapping of its fields,
            or True for the defaults); its predictor learns from `report_losses`. None: off.
        """
        seq_len = _check_int("seq_len", seq_len, 1)
        batch_size = _check_int("batch_size", batch_size, 1)
        seed = _check_int("seed", seed, 0)
        if epochs is not None:
            epochs = _check_int("epochs", epochs, 1)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        shuffle_window = _check_int("shuffle_window", shuffle_window, 1)
        lookahead = _check_int("lookahead", lookahead, 1)
        max_open_bins = _check_int("max_open_bins", max_open_bins, 0)
        self.loss_memory = _check_int("loss_memory", loss_memory, 0)
        cache_shards = _check_int("cache_shards", cache_shards, 1)
        self.prefetch_factor = _check_int("prefetch_factor", prefetch_factor, 1)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        if rank is None or world_size is None:
            dist_rank, dist_world = _dist_rank_world()
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        world_size = _check_int("world_size", world_size, 1)
        rank = _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if curriculum is not None and not isinstance(curriculum, Curriculum):
            raise ValueError(f"curriculum must be a Curriculum or None, got {curriculum!r}")

        self.source = os.fspath(source) if isinstance(source, os.PathLike) else str(source)
        self.manifest = shards.read_manifest(self.source)
        layout = self._layout = _Layout(self.manifest)
        if not layout.domains:
            raise ValueError(f"source {self.source!r} holds no documents (manifest total_docs=0)")

        if mixture is None:
            schedule = None
        elif isinstance(mixture, MixtureSchedule):
            schedule = mixture
        elif isinstance(mixture, Mapping):
            schedule = MixtureSchedule.constant(mixture)
        else:
            raise ValueError(f"mixture must be None, a mapping of domain weights or a MixtureSchedule, got {mixture!r}")
        if schedule is not None:
            unknown = sorted(set(schedule.domains) - set(layout.domains))
            if unknown:
                raise ValueError(f"mixture names domains {unknown!r} that the manifest lacks; "
                                 f"its domains are {list(layout.domains)!r}")

        if isinstance(long_docs, str):
            check_policy("long_docs", long_docs)
            policies = {d: long_docs for d in layout.domains}
        elif isinstance(long_docs, Mapping):
            for key, value in long_docs.items():
                if key != "*" and key not in layout.domains:
                    raise ValueError(f"long_docs key must be '*' or a domain of the manifest "
                                     f"{list(layout.domains)!r}, got {key!r}")
                check_policy(f"long_docs[{key!r}]", value)
            default = long_docs.get("*", "split")
            policies = {d: long_docs.get(d, default) for d in layout.domains}
        else:
            raise ValueError(f"long_docs must be one of {{'split', 'truncate', 'drop'}} or a mapping, got {long_docs!r}")

        self._cfg = _Config(
            source=self.source, seq_len=seq_len, batch_size=batch_size, seed=seed, epochs=epochs, rank=rank,
            world_size=world_size, shuffle=shuffle, shuffle_window=shuffle_window, lookahead=lookahead,
            max_open_bins=max_open_bins, policies=policies, schedule=schedule, curriculum=curriculum,
            cache_shards=cache_shards, natural=MixtureSchedule.natural(self.manifest),
            prioritize=prio.Prioritize.from_value(prioritize),
        )
        self._predictor = prio.LossPredictor(self._cfg.prioritize) if self._cfg.prioritize else None
        # Loss reports queue here and the predictor learns them in order, up to a point fixed by the
        # batch count (`_learn_until`): then a prefetch thread running ahead of the trainer cannot
        # change which documents are kept.
        self._reports = threading.Condition()
        self._n_reports = 0  # report_losses calls so far
        self._applied = 0  # of them, learnt by the predictor
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # reported, not yet learnt
        self._reader = _Reader(self.source, layout, cache_shards)
        planner = _Planner(self._cfg, layout, self._reader)
        if int(self.manifest.get("total_docs", 0)) < world_size:
            raise ValueError(f"world_size must be at most the manifest's total_docs="
                             f"{self.manifest.get('total_docs')!r} (every rank needs documents), got {world_size!r}")
        self._planner_state = planner.state_dict()
        self._stats = {"batches": 0, "rows": 0, "tokens": 0, "domain_tokens": {d: 0 for d in layout.domains}}
        self._losses: OrderedDict[int, list[float]] = OrderedDict()

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        pcfg = self._cfg.prioritize
        while True:
            # prioritization: every `refresh` served batches the planner gets the live predictor, and the
            # batch source restarts from the current state (the planner is a pure function of its state)
            if pcfg and self._stats["batches"] % pcfg.refresh == 0:
                self._learn_until(self._stats["batches"] - pcfg.lag)
                with self._reports:
                    snapshot = self._predictor.snapshot()
                self._planner_state = {**self._planner_state, "predictor": snapshot}
            served = 0
            for batch in self._iter_source():
                yield batch
                served += 1
                if pcfg and self._stats["batches"] % pcfg.refresh == 0:
                    break
            else:
                return
            if not served:
                return

    def _learn_until(self, n: int, timeout_s: float = 600.0) -> None:
        """Teach the predictor exactly the first `n` loss reports, waiting for them to arrive."""
        with self._reports:
            if n <= self._applied:
                return
            if not self._reports.wait_for(lambda: self._n_reports >= n, timeout=timeout_s):
                raise RuntimeError(
                    f"prioritize: batch {self._stats['batches']} needs the first {n} loss reports, but "
                    f"{self._n_reports} came in {timeout_s:.0f} s; call report_losses once per batch"
                )
            todo, self._pending = self._pending[: n - self._applied], self._pending[n - self._applied :]
            for feats, means in todo:
                self._predictor.update(feats, means)
            self._applied = n

    def _iter_source(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.num_workers == 0:
            source = _batches(self._cfg, self._layout, self._planner_state, 0, 1, self._reader)
        else:
            source = iter(torch.utils.data.DataLoader(
                _PackedDataset(self._cfg, self._layout, self._planner_state), batch_size=None,
                num_workers=self.num_workers, collate_fn=_identity, prefetch_factor=self.prefetch_factor,
            ))
        for arrays, meta in source:
            full = expand_batch(**arrays)
            batch = {key: torch.from_numpy(full[key]) for key in BATCH_KEYS}
            self._planner_state = meta["state"]
            st = self._stats
            st["batches"] += 1
            st["rows"] += meta["rows"]
            for d, n in zip(self._layout.domains, meta["domain_tokens"]):
                st["domain_tokens"][d] += n
                st["tokens"] += n
            yield batch

    @property
    def epoch(self) -> int:
        """The epoch of the next document to be drawn."""
        return int(self._planner_state["epoch"])

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable state: a loader given it continues with the next batch, bitwise."""
        return {
            "version": STATE_VERSION,
            "config": self._cfg.fingerprint(self._layout),
            "planner": copy.deepcopy(self._planner_state),
            "stats": {**self._stats, "domain_tokens": dict(self._stats["domain_tokens"])},
            "losses": [[doc, v[0], int(v[1])] for doc, v in self._losses.items()],
            **({"predictor": self._predictor_state()} if self._predictor else {}),
        }

    def _predictor_state(self) -> dict[str, Any]:
        with self._reports:
            return {"model": self._predictor.state_dict(), "applied": self._applied, "reports": self._n_reports,
                    "pending": [[f.tolist(), m.tolist()] for f, m in self._pending]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else state
            raise ValueError(f"state['version'] must be {STATE_VERSION}, got {got!r}")
        ours = self._cfg.fingerprint(self._layout)
        theirs = state.get("config", {})
        for key, value in ours.items():
            if theirs.get(key) != value:
                raise ValueError(f"state['config'][{key!r}] is {theirs.get(key)!r} but this loader has {value!r}; "
                                 "build the loader with the settings of the saved run to resume it exactly")
        planner = _Planner(self._cfg, self._layout, self._reader)
        planner.load_state_dict(state["planner"])  # validates the shape before anything changes
        self._planner_state = planner.state_dict()
        stats = state["stats"]
        self._stats = {"batches": int(stats["batches"]), "rows": int(stats["rows"]), "tokens": int(stats["tokens"]),
                       "domain_tokens": {d: int(stats["domain_tokens"].get(d, 0)) for d in self._layout.domains}}
        self._losses = OrderedDict((int(doc), [float(v), int(n)]) for doc, v, n in state.get("losses", []))
        if self._predictor is not None:
            self._predictor = prio.LossPredictor(self._cfg.prioritize)
            saved = state.get("predictor")
            with self._reports:
                self._applied = self._n_reports = 0
                self._pending = []
                if saved:
                    self._predictor.load_state_dict(saved["model"])
                    self._applied, self._n_reports = int(saved["applied"]), int(saved["reports"])
                    self._pending = [(np.array(f, dtype=np.float64), np.array(m, dtype=np.float64))
                                     for f, m in saved["pending"]]

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
            "weights": schedule.weights_at(plan["tokens_drawn"] * self._cfg.world_size),  # at the current position
            "tokens_drawn": int(plan["tokens_drawn"]),
            **plan["counters"],
            "losses_remembered": len(self._losses),
        }

    def report_losses(self, doc_ids: Sequence[int] | torch.Tensor | np.ndarray,
                      losses: Sequence[float] | torch.Tensor | np.ndarray) -> None:
        """Remember per-document losses from the trainer (mean per document per call, then an EMA, 0.9 decay).

        Memory is bounded by `loss_memory` documents (the least recently reported are forgotten).
        Ids < 0 (padding) are ignored. The losses are part of the state. With `prioritize`, each call also
        trains the loss predictor on the documents' static features and this call's mean losses.
        """
        ids = np.asarray(doc_ids.detach().cpu() if isinstance(doc_ids, torch.Tensor) else doc_ids).reshape(-1)
        vals = np.asarray(losses.detach().float().cpu() if isinstance(losses, torch.Tensor) else losses,
                          dtype=np.float64).reshape(-1)
        if ids.shape != vals.shape:
            raise ValueError(f"doc_ids and losses must have the same number of elements, got {ids.size!r} and {vals.size!r}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"doc_ids must be integers, got dtype {str(ids.dtype)!r}")
        keep = (ids >= 0) & np.isfinite(vals)
        ids, vals = ids[keep].astype(np.int64), vals[keep]
        if not ids.size:
            return
        uniq, inv = np.unique(ids, return_inverse=True)
        means = np.bincount(inv, weights=vals) / np.bincount(inv)
        if self._predictor is not None:
            feats = np.asarray(self._reader.features(uniq.tolist(), self._cfg.prioritize), dtype=np.float64)
            with self._reports:
                self._pending.append((feats, means))
                self._n_reports += 1
                self._reports.notify_all()
        if not self.loss_memory:
            return
        for doc, loss in zip(uniq.tolist(), means.tolist()):
            entry = self._losses.pop(doc, None)
            if entry is None:
                entry = [loss, 0]
            else:
                entry[0] = 0.9 * entry[0] + 0.1 * loss
            entry[1] += 1
            self._losses[doc] = entry
        while len(self._losses) > self.loss_memory:
            self._losses.popitem(last=False)

    def losses(self) -> dict[int, float]:
        """The remembered loss of each reported document."""
        return {doc: v[0] for doc, v in self._losses.items()}


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
