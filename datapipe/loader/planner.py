"""The loader's batch planning: which pieces of which documents fill each row, from document lengths alone.

The document stream is a pure function of (seed, rank, world_size, position):
- **Pass p of domain d.** The shards that hold domain d, in an order permuted by (seed, p). Their
  documents of domain d, in that order, are cut into `world_size` contiguous ranges of equal
  served-token count, one per rank, so every rank holds every domain in the same proportion. A cut
  falls between two documents or, inside a long document under `split`, between two of its
  `seq_len` chunks (a document that fits a row is never cut); in epoch mode each domain's cut also
  makes up the rounding of the domains before it, so every rank's epoch holds the same tokens to
  within one row and the ranks end it within one batch of each other (`DomainPass`). The rank's range is
  cut into windows of `shuffle_window` documents that touch at most `shuffle_shards` shards. What a
  window permutes are *units*: a document that fits a row (or any document under `truncate` or
  `drop`) is one unit, a longer one under `split` is one unit per `seq_len` chunk. Each window's
  units are permuted by (seed, p, rank, d, window), so a long document's chunks are scattered among
  the window's other units instead of filling consecutive rows (a 733 k-token document at seq_len
  256 once filled ~179 batches in a row). It is a bounded shuffle whose position is (window, unit),
  not a buffer; a chunk moves only within its window, so a document with more chunks than its
  window has other units still fills most of that window's rows. The shard bound keeps the reads
  independent of the shard count: a window opens its few shards once, reads their lengths, and
  holds them open until the next window (`reader.ShardHolds`),
  so many small shards are each opened once per pass rather than once per document drawn (on big
  shards a window is `shuffle_window` documents, as without the bound). With a `Curriculum`, the
  whole range is instead ordered by the score column (ties in shuffled order), one unit per document.
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
- **Prioritization** (optional, `datapipe.loader.prioritize`): the domain's units are drawn a pool at
  a time and only some are kept, sampled by predicted loss under a floor; the others are skipped in
  this pass (`docs_skipped` counts them: a long document's chunks are kept or skipped one by one,
  each counted as one). The pools waiting and the predictor snapshot are part of the planner state.
- **Online mixing** (optional, `datapipe.loader.online_mixing`): the sampler's weights are the
  snapshot of a bandit's policy (part of the planner state) instead of the schedule's.
- **Packing** (`packing.BFDPacker`) packs the drawn units into rows, each unit one piece (a
  curriculum's long document enters as its chunks); it is flushed at each epoch end, so no row
  mixes two epochs. Rows are grouped `batch_size` at a time; only the very
  last batch of a finite run can hold padding rows. The planner holds the shard of every piece
  from its draw until the batch after its own is planned (its tokens are built by then), so a
  piece waiting in the look-ahead never costs a reopen.
- **Compiled runs.** Drawing a unit is a few arithmetic steps (choose the domain, take its next unit, cut it
  into pieces, count), which cost more in Python than building the batch at long rows. So the planner draws
  runs of units in one compiled call (`kernels.draw_units`) for as long as nothing else decides: it stops
  before a weight change, an epoch's end, a window to load, a pass to start or a pack of the look-ahead
  buffer, and the one-unit Python step (`_advance`) takes that unit. Prioritization draws in Python only.
  Same units, same state: the tests compare both paths.

The planner's state (a JSON-ready dict) is: the epoch, tokens drawn, per-domain (pass, window,
unit, done), the sampler's credit and served tokens, the packer's buffered pieces and open bins,
the rows planned but not yet batched (pieces as [doc, start, end, doc_len, domain, seq]), counters, and with
prioritization the kept units waiting per domain and the predictor snapshot in use, with online
mixing the policy snapshot in use. Every random choice is drawn from a generator keyed by (seed,
tag, pass, rank, domain, window): there is no RNG state to carry.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from datapipe.core.config import ConfigError
from datapipe.loader import kernels
from datapipe.loader import online_mixing as om
from datapipe.loader import prioritize as prio
from datapipe.loader.packing import SPLIT, BFDPacker, Piece, Row, served_lengths, split_document
from datapipe.loader.reader import Layout, Reader, ShardHolds
from datapipe.loader.schedule import Curriculum, DeficitSampler, MixtureSchedule

_TAG_SHARDS, _TAG_WINDOW, _TAG_PRIO = 1, 2, 3
_POLICY_CODES = {SPLIT: kernels.SPLIT, "truncate": kernels.TRUNCATE, "drop": kernels.DROP}


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
    online_mixing: om.OnlineMixing | None = None  # domain weights learnt online (datapipe/loader/online_mixing.py)
    verify: bool | str = True  # check each shard against the manifest when first opened, or "always" (reader.ShardVerifier)

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
            **({"online_mixing": self.online_mixing.to_dict()} if self.online_mixing else {}),
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
    """This rank's draws from one domain in one pass, a window at a time: `draw((w, u))` is unit u of
    window w, (doc id, length, start, end), where [start, end) is the part of the document the unit
    serves, and the position after it.

    Window w holds the documents at positions [bounds[w], bounds[w + 1]) of the rank's range:
    `shuffle_window` documents, ending earlier where that would touch more than `shuffle_shards`
    shards. Loading the window expands it into units: a document longer than `seq_len` under
    `split` is one unit per `seq_len` chunk (the chunks `packing.split_document` cuts, within the
    rank's part of the document at the two ends of its range, see `DomainPass`); any other
    document is one unit, the rank's part of it. The window's units are permuted by (seed, pass,
    rank, domain, w), so a long document's chunks are scattered among the window's other units
    rather than served back to back. The bounds need only the manifest's counts; loading a window
    reads the lengths of its shards (a resumed loader opens no shard of the windows it does not
    draw from) and holds them open while the window is drawn from. A curriculum needs every score
    of the range at once: its one window is the whole range, one unit per document, in score order.
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
        self.windows = len(self.bounds) - 1
        self._w = -1  # the window loaded
        self.units = np.zeros((0, 4), dtype=np.int64)  # its units in draw order: [doc, length, start, end]
        self._holds: ShardHolds | None = None  # the window's shards, held open while it is drawn from

    def _window_bounds(self) -> np.ndarray:
        """The first position of each window, and n last."""
        if self.cfg.curriculum:
            return np.array([0, self.n] if self.n else [0], dtype=np.int64)
        bounds = [0]
        a, end, last = self.lo, self.lo + self.n, len(self.starts) - 1
        while a < end:
            i = int(np.searchsorted(self.starts, a, side="right")) - 1  # the shard holding position a
            a = min(a + self.cfg.shuffle_window, int(self.starts[min(i + self.cfg.shuffle_shards, last)]), end)
            bounds.append(a - self.lo)
        return np.array(bounds, dtype=np.int64)

    def draw(self, pos: tuple[int, int]) -> tuple[list[int], tuple[int, int]]:
        """The unit at position (window, unit) and the position after it ((windows, 0) past the end)."""
        w, u = pos
        if w != self._w:
            self._load_window(w)
        return self.units[u].tolist(), ((w, u + 1) if u + 1 < len(self.units) else (w + 1, 0))

    def loaded(self, pos: tuple[int, int]) -> np.ndarray | None:
        """The units from position `pos` to its window's end, if that window is loaded (None: it is not)."""
        return self.units[pos[1]:] if pos[0] == self._w else None

    def _load_window(self, w: int) -> None:
        a, b = int(self.bounds[w]), int(self.bounds[w + 1])
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
        ids_, lens_ = np.concatenate(ids).astype(np.int64), np.concatenate(lens)
        # the rank's part [start, end) of each document: all of it but at the two ends of the range
        at = np.arange(self.lo + a, self.lo + b)
        starts = np.where(at == self.lo, self.lo_off, 0)
        ends = np.where((at == self.hi) & (self.hi_off > 0), self.hi_off, lens_)
        rng = keyed_rng(self.cfg.seed, _TAG_WINDOW, self.pass_, self.cfg.rank, self.d_idx, w) if self.cfg.shuffle else None
        if self.cfg.curriculum:  # order the whole range by score, one unit per document; ties keep the shuffled order
            perm = rng.permutation(b - a) if rng is not None else np.arange(b - a)
            sc = np.concatenate(scores)[perm]
            units = np.column_stack([ids_, lens_, starts, ends])[
                perm[np.argsort(-sc if self.cfg.curriculum.descending else sc, kind="stable")]]
        else:  # one unit per document, or per seq_len chunk of a long split document (split_document's chunks)
            seq_len = self.cfg.seq_len
            chunked = (lens_ > seq_len) if self.cfg.policies[self.domain] == SPLIT else np.zeros(len(lens_), dtype=bool)
            count = np.where(chunked, -(-(ends - starts) // seq_len), 1)
            j = np.repeat(np.arange(len(lens_)), count)  # each unit's document
            k = np.arange(len(j)) - np.repeat(np.cumsum(count) - count, count)  # the unit's chunk in its document
            ustart = starts[j] + k * seq_len
            uend = np.where(chunked[j], np.minimum(ustart + seq_len, ends[j]), ends[j])
            units = np.column_stack([ids_[j], lens_[j], ustart, uend])
            if rng is not None:
                units = units[rng.permutation(len(units))]
        self.units = np.ascontiguousarray(units, dtype=np.int64)
        self._w = w


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
        self.pos: dict[str, tuple[int, int]] = {d: (0, 0) for d in self.domains}  # (window, unit) in the pass
        self.done = {d: False for d in self.domains}
        self.excluded: set[str] = set()  # mixture mode: domains this rank never gets a document of
        self.pending: list[Row] = []
        # `pending` as the state holds it, each row serialised once (the state is taken every batch and
        # a pack queues up to `lookahead` rows); never mutated, so states may share its rows
        self._pending_lists: list[list[list[int]]] = []
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
        self.mixing: dict[str, float] | None = None  # online mixing: the policy snapshot in use (None: the prior)

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
        if self.mixing is not None:
            return dict(self.mixing)
        return self.schedule.weights_at(self.tokens_drawn * self.cfg.world_size)

    def _advance(self) -> None:
        """Draw one unit (a document, or a chunk of a long split one) into the packer, or close the epoch."""
        cfg = self.cfg
        if self._epoch_over():
            self._queue(self.packer.flush())
            self.epoch += 1
            self.epoch_tokens = 0
            if cfg.schedule is None:  # epoch mode: every domain starts its next pass together
                self.passes = {d: self.epoch for d in self.domains}
                self.pos = {d: (0, 0) for d in self.domains}
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
            doc, n, start, end = self._draw(d, stream)
            if cfg.schedule is None and self.pos[d][0] >= stream.windows:
                self.done[d] = True
        policy = cfg.policies[d]
        pieces = split_document(doc, n, cfg.seq_len, policy, tag=stream.d_idx, seq=self.next_seq, start=start, end=end)
        self.next_seq += 1
        kept = sum(p.length for p in pieces)
        c = self.counters
        if start == 0:  # a document counts once: on its first chunk, on the rank holding its start
            c["docs_drawn"] += 1
            if n > cfg.seq_len:
                c[{"split": "docs_split", "truncate": "docs_truncated", "drop": "docs_dropped"}[policy]] += 1
        c["tokens_dropped"] += end - start - kept
        self.sampler.record(d, kept, weights, eligible)
        self.tokens_drawn += kept
        self.epoch_tokens += kept
        for p in pieces:
            self.holds.add(self.layout.shard_of(p.doc))
            self._queue(self.packer.push(p))

    def _draw_run(self) -> int:
        """Draw units into the packer's buffer as `_advance` would, many at once, until a unit needs `_advance`
        itself (see `kernels.draw_units`): how many were drawn. Prioritization keeps to `_advance`."""
        cfg = self.cfg
        if cfg.prioritize or self._epoch_over():
            return 0
        tokens = self.tokens_drawn * cfg.world_size
        steady = math.inf if self.mixing is not None else self.schedule.steady_until(tokens)
        if steady <= tokens:
            return 0
        weights = self.weights()
        cand = [not self.done[d] and d not in self.excluded and weights.get(d, 0.0) > 0 for d in self.domains]
        total = sum(weights[d] for d, c in zip(self.domains, cand) if c)  # DeficitSampler.record's sum, in its order
        share = np.array([weights[d] / total if c else 0.0 for d, c in zip(self.domains, cand)])
        units, first, avail, ends = self._loaded_units(cand)
        sampler = self.sampler
        credit = np.array([sampler.credit[d] for d in self.domains], dtype=np.float64)
        served = np.array([sampler.served[d] for d in self.domains], dtype=np.int64)
        used = np.zeros(len(self.domains), dtype=np.int64)
        counts = np.zeros(len(kernels.COUNTS), dtype=np.int64)
        counts[:3] = self.tokens_drawn, self.epoch_tokens, self.next_seq
        pieces = np.empty((self.packer.room, 6), dtype=np.int64)
        policy = np.array([_POLICY_CODES[cfg.policies[d]] for d in self.domains], dtype=np.int64)
        target = self.epoch_target if cfg.schedule is not None else -1
        kernels.draw_units(units, first, avail, ends, np.array(cand), share, policy, credit, served, used, counts,
                           pieces, cfg.seq_len, cfg.world_size, float(steady), target)
        self._apply_run(used, credit.tolist(), served.tolist(), counts, pieces[:counts[-1]])
        return int(used.sum())

    def _loaded_units(self, cand: list[bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next units of each candidate domain whose window is loaded, at most `lookahead` each (the most
        one run can place unless drops), stacked: (units, first row, count, whether they end the window)."""
        parts, first, avail, ends, at = [], [], [], [], 0
        for d, c in zip(self.domains, cand):
            st = self._streams.get(d)
            rest = st.loaded(self.pos[d]) if c and st is not None and st.pass_ == self.passes[d] else None
            part = rest[:self.cfg.lookahead] if rest is not None else np.zeros((0, 4), dtype=np.int64)
            parts.append(part)
            first.append(at)
            avail.append(len(part))
            ends.append(rest is not None and self.pos[d][1] + len(part) == len(st.units))
            at += len(part)
        return (np.concatenate(parts) if len(parts) > 1 else parts[0], np.array(first, dtype=np.int64),
                np.array(avail, dtype=np.int64), np.array(ends))

    def _apply_run(self, used: np.ndarray, credit: list[float], served: list[int], counts: np.ndarray,
                   pieces: np.ndarray) -> None:
        """The planner's state after a compiled run: positions (and, past a window's end, what `_draw` and
        `_advance` do there), the sampler, the counters, and the pieces pushed to the packer."""
        for d, k in zip(self.domains, used.tolist()):
            if k:
                st, (w, u) = self._streams[d], self.pos[d]
                self.pos[d] = (w, u + k) if u + k < len(st.units) else (w + 1, 0)
                if self.pos[d][0] >= st.windows:
                    if self.cfg.schedule is not None:
                        self.passes[d] += 1
                        self.pos[d] = (0, 0)
                    else:
                        self.done[d] = True
        self.sampler.credit = dict(zip(self.domains, credit))
        self.sampler.served = dict(zip(self.domains, served))
        c = dict(zip(kernels.COUNTS, counts.tolist()))
        self.tokens_drawn, self.epoch_tokens, self.next_seq = c["tokens_drawn"], c["epoch_tokens"], c["next_seq"]
        for key in ("docs_drawn", "docs_split", "docs_truncated", "docs_dropped", "tokens_dropped"):
            self.counters[key] += c[key]
        for s in self.layout.shards_of(pieces[:, 0]).tolist():
            self.holds.add(s)
        self.packer.extend([Piece(*p) for p in pieces.tolist()])  # the run stopped short of a pack

    def _queue(self, rows: list[Row]) -> None:
        self.pending += rows
        self._pending_lists += [[p.to_list() for p in row] for row in rows]

    def _draw(self, d: str, stream: DomainStream) -> list[int]:
        """The unit at domain d's position, moving the position past it; in mixture mode a domain
        past its last unit starts its next pass on its own (epoch mode leaves it past the end)."""
        unit, self.pos[d] = stream.draw(self.pos[d])
        if self.pos[d][0] >= stream.windows and self.cfg.schedule is not None:
            self.passes[d] += 1
            self.pos[d] = (0, 0)
        return unit

    def _draw_prioritized(self, d: str) -> tuple[int, int, int, int]:
        """The next kept unit of domain d: refill a pool of units from the stream, keep some by predicted loss."""
        cfg, pcfg, queue = self.cfg, self.cfg.prioritize, self.queues[d]
        if not queue:
            pool: list[list[int]] = []
            while len(pool) < pcfg.pool:
                st = self._stream(d)
                if st.n == 0 or (cfg.schedule is None and self.pos[d][0] >= st.windows):
                    break
                pool.append(self._draw(d, st))
            keep = max(1, round(pcfg.keep * len(pool)))
            pred = None
            if self.predictor is not None:
                pred = prio.predict(self.predictor, self.reader.features([x[0] for x in pool], pcfg))
            rng = keyed_rng(cfg.seed, _TAG_PRIO, cfg.rank, self.layout.domains.index(d), self.next_seq)
            queue.extend(pool[i] for i in prio.select(len(pool), pred, keep, pcfg, rng))
            self.counters["docs_skipped"] += len(pool) - keep
        doc, n, start, end = queue.pop(0)
        if cfg.schedule is None and not queue and self.pos[d][0] >= self._stream(d).windows:
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
            if not self._draw_run():  # the compiled loop stopped at a unit that needs the one-unit step
                self._advance()
            if self.epoch > first_epoch + 2 and not self.pending:  # whole epochs without a document
                raise ConfigError(f"rank {self.cfg.rank} of world_size={self.cfg.world_size} gets no documents "
                                  f"from this manifest; use a smaller world_size")
        if not self.pending:
            return None
        rows, self.pending = self.pending[:bs], self.pending[bs:]
        self._pending_lists = self._pending_lists[bs:]
        self._handed = rows
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "tokens_drawn": self.tokens_drawn,
            "epoch_tokens": self.epoch_tokens,
            "next_seq": self.next_seq,
            "domains": {d: [self.passes[d], *self.pos[d], self.done[d]] for d in self.domains},
            "excluded": sorted(self.excluded),
            "sampler": self.sampler.state_dict(),
            "packer": self.packer.state_dict(),
            "pending": list(self._pending_lists),
            "counters": dict(self.counters),
            **({"queues": {d: [list(x) for x in q] for d, q in self.queues.items()},
                "predictor": copy.deepcopy(self.predictor)} if self.cfg.prioritize else {}),
            **({"mixing": dict(self.mixing) if self.mixing is not None else None} if self.cfg.online_mixing else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.tokens_drawn = int(state["tokens_drawn"])
        self.epoch_tokens = int(state["epoch_tokens"])
        self.next_seq = int(state["next_seq"])
        for d in self.domains:
            p, w, u, done = state["domains"][d]
            self.passes[d], self.pos[d], self.done[d] = int(p), (int(w), int(u)), bool(done)
        self.excluded = set(state["excluded"])
        self.sampler.load_state_dict(state["sampler"])
        self.packer.load_state_dict(state["packer"])
        self.pending, self._pending_lists = [], []
        self._queue([[Piece.from_list(p) for p in row] for row in state["pending"]])
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
        if self.cfg.online_mixing:
            mixing = state.get("mixing")
            self.mixing = {d: float(mixing[d]) for d in self.domains} if mixing is not None else None
