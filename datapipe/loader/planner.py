"""The loader's batch planning: which pieces of which documents fill each row, from document lengths alone.

The document stream is a pure function of (seed, rank, world_size, position):
- **Pass p of domain d.** The shards that hold domain d, in an order permuted by (seed, p). Their
  documents of domain d, in that order, are cut into `world_size` contiguous ranges of equal
  served-token count, one per rank, so every rank holds every domain in the same proportion. A cut
  falls between two documents or, inside a long document under `split`, between two of its
  `seq_len` chunks (a document that fits a row is never cut); in epoch mode each domain's cut also
  makes up the rounding of the domains before it, so every rank's epoch holds the same tokens to
  within one row and the ranks end it within one batch of each other (`DomainPass`). The rank's range is
  cut into windows of `shuffle_window` documents that touch at most `shuffle_shards` shards, each
  permuted by (seed, p, rank, d, window): a bounded shuffle whose position is one integer, not a
  buffer. The shard bound keeps the reads independent of the shard count: a window opens its few
  shards once, reads their lengths, and holds them open until the next window (`reader.ShardHolds`),
  so many small shards are each opened once per pass rather than once per document drawn (on big
  shards a window is `shuffle_window` documents, as without the bound). With a `Curriculum`, the
  whole range is instead ordered by the score column (ties in shuffled order).
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
- **Prioritization** (optional, `datapipe.loader.prioritize`): the domain's documents are drawn a pool at
  a time and only some are kept, sampled by predicted loss under a floor; the others are skipped in
  this pass. The pools waiting and the predictor snapshot are part of the planner state.
- **Packing** (`packing.BFDPacker`) packs the drawn documents into rows; it is flushed at each
  epoch end, so no row mixes two epochs. Rows are grouped `batch_size` at a time; only the very
  last batch of a finite run can hold padding rows. The planner holds the shard of every piece
  from its draw until the batch after its own is planned (its tokens are built by then), so a
  piece waiting in the look-ahead never costs a reopen.

The planner's state (a JSON-ready dict) is: the epoch, tokens drawn, per-domain (pass, position,
done), the sampler's credit and served tokens, the packer's buffered pieces and open bins, the rows
planned but not yet batched (pieces as [doc, start, end, doc_len, domain, seq]), counters, and with
prioritization the kept documents waiting per domain and the predictor snapshot in use. Every random
choice is drawn from a generator keyed by (seed, tag, pass, rank, domain, window): there is no RNG
state to carry.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.core.config import ConfigError
from datapipe.loader import prioritize as prio
from datapipe.loader.packing import SPLIT, BFDPacker, Piece, Row, served_lengths, split_document
from datapipe.loader.reader import Layout, Reader, ShardHolds
from datapipe.loader.schedule import Curriculum, DeficitSampler, MixtureSchedule

_TAG_SHARDS, _TAG_WINDOW, _TAG_PRIO = 1, 2, 3


def keyed_rng(*key: int) -> np.random.Generator:
    """A generator that is a pure function of its integer key: no RNG state to carry."""
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


@dataclass(frozen=True)
class PlanConfig:
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
    shuffle_shards: int
    lookahead: int
    max_open_bins: int
    policies: dict[str, str]
    schedule: MixtureSchedule | None  # None: epoch mode, natural weights
    curriculum: Curriculum | None
    cache_shards: int
    natural: MixtureSchedule  # the manifest's token shares: the weights when schedule is None
    prioritize: prio.Prioritize | None = None  # loss-aware document selection (datapipe/loader/prioritize.py)
    verify: bool = True  # check each shard against the manifest when first opened (reader.ShardVerifier)

    def fingerprint(self, layout: Layout) -> dict[str, Any]:
        """The settings a state must match to resume exactly (batch size and workers may change)."""
        return {
            "manifest": layout.fingerprint,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "shuffle_shards": self.shuffle_shards,
            "lookahead": self.lookahead,
            "max_open_bins": self.max_open_bins,
            "long_docs": dict(sorted(self.policies.items())),
            "mixture": self.schedule.to_dict() if self.schedule else None,
            "curriculum": self.curriculum.to_dict() if self.curriculum else None,
            **({"prioritize": self.prioritize.to_dict()} if self.prioritize else {}),
        }


class DomainPass:
    """One pass of one domain: its shards in the pass's order, and the cut of its tokens between ranks.

    A cut falls on a unit boundary: a document that fits a row is a unit, a longer one under
    `split` is cut anyway into `seq_len` chunks and each chunk is a unit, so a rank's part can
    begin or end inside such a document, at a chunk boundary. Tokens here are the tokens served
    (after `truncate` or `drop`). With `split` the manifest's per-shard counts place a cut in one
    shard, whose lengths are then read; with `truncate` or `drop` every shard's lengths are read once.
    """

    def __init__(self, cfg: PlanConfig, layout: Layout, reader: Reader, domain: str, pass_: int) -> None:
        self.cfg, self.layout, self.reader = cfg, layout, reader
        self.domain, self.pass_ = domain, pass_
        self.policy = cfg.policies[domain]
        counts = layout.domain_docs[domain]
        order = np.arange(len(counts))
        if cfg.shuffle:
            order = keyed_rng(cfg.seed, _TAG_SHARDS, pass_).permutation(len(counts))
        self.order = order[counts[order] > 0]
        self.starts = np.concatenate([[0], np.cumsum(counts[self.order])])  # first document of each shard
        self.docs = int(self.starts[-1])
        self._tstarts: np.ndarray | None = None

    @property
    def tstarts(self) -> np.ndarray:
        """The served tokens before each shard of the pass (and the total, last)."""
        if self._tstarts is None:
            if self.policy == SPLIT:
                tokens = self.layout.domain_tokens[self.domain][self.order]
            else:
                tokens = np.array([self.reader.served_tokens(int(s), self.domain, self.policy, self.cfg.seq_len)
                                   for s in self.order], dtype=np.int64)
            self._tstarts = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        return self._tstarts

    @property
    def total(self) -> int:
        return int(self.tstarts[-1])

    def cut(self, target: float) -> tuple[int, int, int]:
        """The unit boundary nearest `target` served tokens: (document position, token offset in it,
        served tokens before it). Ties go to the later boundary (the unit to the earlier rank)."""
        if target <= 0:
            return 0, 0, 0
        tstarts = self.tstarts
        if target >= tstarts[-1]:
            return self.docs, 0, int(tstarts[-1])
        i = int(np.searchsorted(tstarts, target, side="right")) - 1  # tstarts[i] <= target < tstarts[i + 1]
        s = int(self.order[i])
        raw = self.reader.lengths(s)[self.reader.domain_rows(s, self.domain)].astype(np.int64)
        served = served_lengths(raw, self.cfg.seq_len, self.policy)
        before = int(tstarts[i]) + np.concatenate([[0], np.cumsum(served)[:-1]])
        j = int(np.searchsorted(before, target, side="right")) - 1  # the document holding the target (served > 0)
        seq_len, n, p = self.cfg.seq_len, int(raw[j]), int(before[j])
        c = int(self.starts[i]) + j
        if self.policy == SPLIT and n > seq_len:  # between two chunks of a long document
            k = int((target - p) // seq_len)
            lo, hi, whole = k * seq_len, min((k + 1) * seq_len, n), n
        else:  # a document served whole (or truncated) is one unit
            lo, hi = 0, int(served[j])
            whole = hi
        if target - (p + lo) < (p + hi) - target:
            return c, lo, p + lo
        return (c + 1, 0, p + hi) if hi == whole else (c, hi, p + hi)


class DomainStream:
    """This rank's documents of one domain in one pass: `doc(k)` is the k-th, (doc id, length,
    start, end), where [start, end) is the rank's part of the document (all of it but at the two
    ends of a rank's range, see `DomainPass`).

    Window w holds positions [bounds[w], bounds[w + 1]) of the rank's range: `shuffle_window`
    documents, ending earlier where that would touch more than `shuffle_shards` shards. Position k
    draws the window's document perm[k - bounds[w]]. The bounds and permutations need only the
    manifest's counts; loading a window reads the lengths of its shards (a resumed loader opens no
    shard of the windows it does not draw from) and holds them open while the window is drawn
    from. A curriculum needs every score of the range at once: its one window is the whole range.
    """

    def __init__(self, cfg: PlanConfig, layout: Layout, reader: Reader, dpass: DomainPass,
                 lo: tuple[int, int], hi: tuple[int, int]) -> None:
        self.cfg, self.layout, self.reader = cfg, layout, reader
        self.domain, self.pass_ = dpass.domain, dpass.pass_
        self.d_idx = layout.domains.index(self.domain)
        self.order, self.starts = dpass.order, dpass.starts
        (self.lo, self.lo_off), (self.hi, self.hi_off) = lo, hi
        self.n = self.hi - self.lo + (1 if self.hi_off > 0 else 0)  # the last document, when only part of it
        self.bounds = self._window_bounds()
        self._a, self._b = 0, 0  # the positions [a, b) of the window loaded
        self._perm = np.zeros(0, dtype=np.int64)
        self._ids = self._lens = np.zeros(0, dtype=np.int64)  # the window's documents in range order
        self._holds: ShardHolds | None = None  # the window's shards, held open while it is drawn from
        self._docs: np.ndarray | None = None  # curriculum: (doc, length, start, end) in order

    def _window_bounds(self) -> np.ndarray:
        """The first position of each window, and n last."""
        if self.cfg.curriculum:
            return np.array([0, self.n], dtype=np.int64)
        bounds = [0]
        a, end, last = self.lo, self.lo + self.n, len(self.starts) - 1
        while a < end:
            i = int(np.searchsorted(self.starts, a, side="right")) - 1  # the shard holding position a
            a = min(a + self.cfg.shuffle_window, int(self.starts[min(i + self.cfg.shuffle_shards, last)]), end)
            bounds.append(a - self.lo)
        return np.array(bounds, dtype=np.int64)

    def doc(self, k: int) -> tuple[int, int, int, int]:
        if not self._a <= k < self._b:
            self._load_window(int(np.searchsorted(self.bounds, k, side="right")) - 1)
        i = k - self._a
        if self._docs is not None:
            return tuple(int(v) for v in self._docs[i])
        j = int(self._perm[i])
        n = int(self._lens[j])
        return (int(self._ids[j]), n, *self._part(self.lo + self._a + j, n))

    def _part(self, c: int, n: int) -> tuple[int, int]:
        """The rank's token range [start, end) of the document at position c, of length n."""
        return (self.lo_off if c == self.lo else 0), (self.hi_off if c == self.hi and self.hi_off > 0 else n)

    def _load_window(self, w: int) -> None:
        a, b = int(self.bounds[w]), int(self.bounds[w + 1])
        size = b - a
        perm = np.arange(size)
        if self.cfg.shuffle:
            perm = keyed_rng(self.cfg.seed, _TAG_WINDOW, self.pass_, self.cfg.rank, self.d_idx, w).permutation(size)
        self._perm, self._a, self._b = perm, a, b
        # the window's documents: ids and lengths, shard by shard (the previous window's holds end here)
        self._holds = None if self.cfg.curriculum else self.reader.holds()
        ids, lens, scores = [], [], []
        x, y = self.lo + a, self.lo + b
        i = int(np.searchsorted(self.starts, x, side="right")) - 1
        while x < y:
            s = int(self.order[i])
            if self._holds is not None:
                self._holds.add(s)
            first, stop = x - int(self.starts[i]), min(y, int(self.starts[i + 1])) - int(self.starts[i])
            rows = self.reader.domain_rows(s, self.domain)[first:stop]
            ids.append(self.layout.offsets[s] + rows)
            lens.append(self.reader.lengths(s)[rows].astype(np.int64))
            if self.cfg.curriculum:
                scores.append(self.reader.column(s, self.cfg.curriculum.column)[rows])
            x += stop - first
            i += 1
        self._ids, self._lens = np.concatenate(ids).astype(np.int64), np.concatenate(lens)
        if self.cfg.curriculum:  # order the whole range by score; ties keep the shuffled order
            parts = np.array([self._part(self.lo + x, int(n)) for x, n in enumerate(self._lens)], dtype=np.int64)
            docs = np.column_stack([self._ids, self._lens, parts.reshape(-1, 2)])
            sc = np.concatenate(scores)[perm]
            self._docs = docs[perm[np.argsort(-sc if self.cfg.curriculum.descending else sc, kind="stable")]]


class Planner:
    """Decides which pieces of which documents fill each row; needs lengths only, never tokens."""

    def __init__(self, cfg: PlanConfig, layout: Layout, reader: Reader) -> None:
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
        # the shards of the pieces in the packer and in `pending`, and of the rows last handed out
        # (their tokens are built before the next call): held open until then
        self.holds = reader.holds()
        self._handed: list[Row] = []
        self.counters = {"docs_drawn": 0, "docs_split": 0, "docs_truncated": 0, "docs_dropped": 0, "tokens_dropped": 0}
        self._streams: dict[str, DomainStream] = {}
        self._passes: dict[tuple[str, int], DomainPass] = {}  # recent passes, for the cuts
        self._cuts: dict[tuple[str, int, int], tuple[int, int, int]] = {}  # (domain, pass, rank) -> cut
        # prioritization: kept documents waiting per domain ([doc, len, start, end]) and the predictor snapshot in use
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

    def _stream(self, d: str) -> DomainStream:
        st = self._streams.get(d)
        if st is None or st.pass_ != self.passes[d]:
            p, r = self.passes[d], self.cfg.rank
            lo, hi = self._cut(d, p, r), self._cut(d, p, r + 1)
            st = self._streams[d] = DomainStream(self.cfg, self.layout, self.reader, self._pass(d, p), lo[:2], hi[:2])
        return st

    def _pass(self, d: str, p: int) -> DomainPass:
        dp = self._passes.get((d, p))
        if dp is None:
            for key in [k for k in self._passes if k[0] == d and k[1] < p]:  # older passes are done with
                del self._passes[key]
            self._cuts = {k: v for k, v in self._cuts.items() if k[0] != d or k[1] >= p}
            dp = self._passes[d, p] = DomainPass(self.cfg, self.layout, self.reader, d, p)
        return dp

    def _cut(self, d: str, p: int, r: int) -> tuple[int, int, int]:
        """Where rank r's part of pass p of domain d begins: (document position, token offset, served
        tokens before it). Ranks split every domain's served tokens evenly, to within one unit (a
        document, or a chunk of a long split document). In epoch mode each domain's cut also makes up
        the rounding of the domains before it (sorted by name), so a rank's total over all domains is
        within one unit of 1/world_size of the epoch: every rank ends the epoch within a batch or so of
        the others. (Cutting at whole documents, by their first token, left two ranks 8% apart on long
        documents; mixture mode balances ranks by its token-counted epochs instead.)
        """
        world = self.cfg.world_size
        if r <= 0:
            return 0, 0, 0
        dp = self._pass(d, p)
        if r >= world:
            return dp.docs, 0, dp.total
        key = (d, p, r)
        if key not in self._cuts:
            target = dp.total * r / world
            i = self.domains.index(d)
            if self.cfg.schedule is None and i > 0:  # epoch mode: carry the rounding of the earlier domains
                before = self.domains[:i]
                total = sum(self._pass(e, p).total for e in before) + dp.total
                target = min(max(total * r / world - sum(self._cut(e, p, r)[2] for e in before), 0), dp.total)
            self._cuts[key] = dp.cut(target)
        return self._cuts[key]

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
                raise ConfigError(
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
            doc, n, start, end = self._draw_prioritized(d)
        else:
            doc, n, start, end = stream.doc(self.pos[d])
            self.pos[d] += 1
            if self.pos[d] >= stream.n:
                if cfg.schedule is None:
                    self.done[d] = True
                else:  # mixture mode: the domain starts its next pass on its own
                    self.passes[d] += 1
                    self.pos[d] = 0
        policy = cfg.policies[d]
        pieces = split_document(doc, n, cfg.seq_len, policy, tag=stream.d_idx, seq=self.next_seq, start=start, end=end)
        self.next_seq += 1
        kept = sum(p.length for p in pieces)
        c = self.counters
        if start == 0:  # a document two ranks share counts on the one holding its start
            c["docs_drawn"] += 1
            if n > cfg.seq_len:
                c[{"split": "docs_split", "truncate": "docs_truncated", "drop": "docs_dropped"}[policy]] += 1
        c["tokens_dropped"] += end - start - kept
        self.sampler.record(d, kept, weights, eligible)
        self.tokens_drawn += kept
        self.epoch_tokens += kept
        for p in pieces:
            self.holds.add(self.layout.shard_of(p.doc))
            self.pending += self.packer.push(p)

    def _draw_prioritized(self, d: str) -> tuple[int, int, int, int]:
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
                pred = prio.predict(self.predictor, self.reader.features([x[0] for x in pool], pcfg))
            rng = keyed_rng(cfg.seed, _TAG_PRIO, cfg.rank, self.layout.domains.index(d), self.next_seq)
            queue.extend(pool[i] for i in prio.select(len(pool), pred, keep, pcfg, rng))
            self.counters["docs_skipped"] += len(pool) - keep
        doc, n, start, end = queue.pop(0)
        if cfg.schedule is None and not queue and self.pos[d] >= self._stream(d).n:
            self.done[d] = True
        return int(doc), int(n), int(start), int(end)

    def next_rows(self) -> list[Row] | None:
        """The rows of the next batch (fewer than batch_size only at the very end), or None."""
        bs = self.cfg.batch_size
        for row in self._handed:  # built by now: their shards may close
            for p in row:
                self.holds.remove(self.layout.shard_of(p.doc))
        self._handed = []
        first_epoch = self.epoch
        while len(self.pending) < bs and not self.finished:
            self._advance()
            if self.epoch > first_epoch + 2 and not self.pending:  # whole epochs without a document
                raise ConfigError(f"rank {self.cfg.rank} of world_size={self.cfg.world_size} gets no documents "
                                  f"from this manifest; use a smaller world_size")
        if not self.pending:
            return None
        rows, self.pending = self.pending[:bs], self.pending[bs:]
        self._handed = rows
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
        self.holds, self._handed = self.reader.holds(), []
        packer = state["packer"]
        for piece in [*packer["buffer"], *(p for b in packer["bins"] for p in b[2]), *(p for r in state["pending"] for p in r)]:
            self.holds.add(self.layout.shard_of(int(piece[0])))
        self.counters = {k: int(v) for k, v in state["counters"].items()}
        self._streams = {}
        if self.cfg.prioritize:
            self.queues = {d: [[int(a), int(b), int(x), int(y)] for a, b, x, y in state["queues"].get(d, [])]
                           for d in self.domains}
            self.predictor = copy.deepcopy(state.get("predictor"))
