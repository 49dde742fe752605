"""Sequence packing: documents into fixed-length rows without attention across documents.

Algorithm (online best-fit decreasing over a bounded look-ahead buffer):
1. A document longer than `seq_len` is cut first, by its domain's policy: `split` into chunks of
   `seq_len` plus one shorter remainder, `truncate` to its first `seq_len` tokens, or `drop`.
   A document that fits is never cut.
2. Every piece enters a look-ahead buffer. When it holds `lookahead` pieces, they are sorted by
   decreasing length (ties: arrival order) and each goes into the open bin with the least room that
   still fits it (best fit; ties: the older bin), or into a new bin. A piece of exactly `seq_len`
   tokens fills a new bin by itself. It waits in the buffer like the others rather than being
   emitted at once: otherwise the full chunks drawn while the buffer fills would all come out
   together, ahead of the buffer's rows, and a long document's chunks would cluster into a few
   batches however well they were shuffled.
3. Full bins are emitted at once. Of the rest, the `max_open_bins` emptiest stay open for the
   next buffer's pieces (which fill them first, largest first); the others are emitted. A bin left
   open through `max_bin_age` buffers is emitted anyway, which bounds how long a document waits.
4. `flush()` (end of an epoch or of the stream) packs what is buffered and emits every bin.
Emitted rows come out in the arrival order of their first piece, so the packed stream follows the
drawn stream up to the look-ahead.

Invariants (tested in tests/datapipe/test_packing.py):
- every row holds at most `seq_len` tokens; every piece is a contiguous token range of one
  document; pieces of one document never share a row;
- with `split`, the multiset of tokens emitted equals the multiset pushed: no token is lost or
  repeated; a document of length ≤ `seq_len` stays whole;
- `build_batch` restarts `position_ids` at every piece, gives each piece its own `cu_seqlens`
  segment (numbered by `segment_ids`) and `doc_ids`, and sets `labels[i] = input_ids[i + 1]` only inside a piece: the last
  token of a document (its EOS) and all padding get -100. The last token of a cut piece is labelled
  with the document's own next token, which lies in the same document.
- the same input gives the same rows, whatever the process: no randomness, no hashing.

Attention segments are the pieces, never the documents: a schedule that restarts a domain's pass
(a mixture) can draw a document twice, and both copies may land side by side in one row with the
same `doc_ids`. `segment_ids` (from `cu_seqlens`) tells them apart; `block_causal_mask` and the
model's attention paths use only it or `cu_seqlens`.

Measured waste (scripts/bench_loader.py, one epoch of the 28.9 M-token curated shared corpus,
lookahead 512, max_open_bins 16; see BENCHMARKS.md): padding is 0.45% of the row slots at seq_len
512, 0.24% at 2048 and 0.18% at 8192, with no document cut that fits a row. Padding every document
(or chunk) to its own row wastes 16%, 49% and 84%; concatenate-and-chunk wastes nothing but cuts
4,244, 6,160 and 2,382 documents that would have fit. A look-ahead of 64 wastes 0.71% at 2048,
one of 2048 wastes 0.17%. These figures predate full-length chunks waiting in the look-ahead with the
other pieces (the chunk-level shuffle): on the quickstart output that costs 0.05-0.07 points (99.76% ->
99.71% of the slots filled at 2048, 99.49% -> 99.42% at 512).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from datapipe.core.config import ConfigError
from datapipe.loader import kernels

SPLIT, TRUNCATE, DROP = "split", "truncate", "drop"
POLICIES = (SPLIT, TRUNCATE, DROP)
IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous token range [start, end) of one document, placed whole into one row."""

    doc: int  # the document's id (the loader's global document index); -1 is reserved for padding
    start: int  # first token of the document in this piece
    end: int  # one past the last token
    doc_len: int  # the whole document's length: decides whether this piece ends the document
    tag: int = 0  # opaque to the packer (the loader's domain index), kept for accounting
    seq: int = 0  # arrival order: breaks ties and orders rows

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_list(self) -> list[int]:
        return [self.doc, self.start, self.end, self.doc_len, self.tag, self.seq]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "Piece":
        return cls(*(int(v) for v in values))


Row = list[Piece]


def check_policy(name: str, value: Any) -> str:
    if value not in POLICIES:
        raise ConfigError(f"{name} must be one of {set(POLICIES)}, got {value!r}")
    return value


def split_document(
    doc: int, doc_len: int, seq_len: int, policy: str = SPLIT, *, tag: int = 0, seq: int = 0,
    start: int = 0, end: int | None = None,
) -> list[Piece]:
    """The pieces a document enters the packer as: itself when it fits, else by `policy`.

    [start, end) selects a part of a long `split` document (a rank's share of it, which begins at a
    chunk boundary): its pieces are the document's own chunks that lie in the part.
    """
    end = doc_len if end is None else end
    if (start, end) != (0, doc_len) and (policy != SPLIT or start % seq_len or not 0 <= start < end <= doc_len):
        raise ValueError(f"a part [start, end) of a document must be a non-empty range of a split document "
                         f"beginning at a multiple of seq_len={seq_len}, got [{start}, {end}) of {doc_len} ({policy})")
    if doc_len <= seq_len:
        return [Piece(doc, 0, doc_len, doc_len, tag, seq)]
    if policy == SPLIT:
        return [Piece(doc, s, min(s + seq_len, end), doc_len, tag, seq) for s in range(start, end, seq_len)]
    if policy == TRUNCATE:
        return [Piece(doc, 0, seq_len, doc_len, tag, seq)]
    if policy == DROP:
        return []
    raise ConfigError(f"policy must be one of {set(POLICIES)}, got {policy!r}")


def served_lengths(lengths: np.ndarray, seq_len: int, policy: str) -> np.ndarray:
    """The tokens of each document that a policy serves: all (`split`), at most seq_len
    (`truncate`), or none of a document longer than seq_len (`drop`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if policy == SPLIT:
        return lengths
    if policy == TRUNCATE:
        return np.minimum(lengths, seq_len)
    if policy == DROP:
        return np.where(lengths > seq_len, 0, lengths)
    raise ConfigError(f"policy must be one of {set(POLICIES)}, got {policy!r}")


class _Bin:
    __slots__ = ("id", "pieces", "used", "age")

    def __init__(self, id: int, pieces: list[Piece] | None = None, age: int = 0) -> None:
        self.id = id
        self.pieces = pieces or []
        self.used = sum(p.length for p in self.pieces)
        self.age = age


class BFDPacker:
    """Online best-fit decreasing over a bounded look-ahead buffer (see the module docstring).

    `push` and `flush` return the rows that became ready, each a list of pieces in arrival order.
    `state_dict()` holds the buffered pieces and the open bins, so a packer rebuilt from it emits
    exactly the rows the original would have.
    """

    def __init__(self, seq_len: int, *, lookahead: int = 512, max_open_bins: int = 16, max_bin_age: int = 4) -> None:
        for name, value, low in (("seq_len", seq_len, 1), ("lookahead", lookahead, 1),
                                 ("max_open_bins", max_open_bins, 0), ("max_bin_age", max_bin_age, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} must be an integer ≥ {low}, got {value!r}")
        self.seq_len = seq_len
        self.lookahead = lookahead
        self.max_open_bins = max_open_bins
        self.max_bin_age = max_bin_age
        self._buffer: list[Piece] = []
        self._bins: dict[int, _Bin] = {}
        self._next_bin = 0
        # state_dict's lists, built on the first call after a change: the loader takes a state every batch and
        # most batches change nothing here. States share them, so they are never mutated, only replaced
        self._state: dict[str, Any] | None = None

    def push(self, piece: Piece) -> list[Row]:
        if not 0 < piece.length <= self.seq_len:
            raise ValueError(f"piece.length must be in [1, seq_len={self.seq_len}], got {piece.length!r}")
        self._buffer.append(piece)
        self._state = None
        if len(self._buffer) >= self.lookahead:
            return self._pack(final=False)
        return []

    def extend(self, pieces: Sequence[Piece]) -> None:
        """`push` of many pieces that leave the buffer short of `lookahead`, so no pack is due."""
        if len(self._buffer) + len(pieces) >= self.lookahead:
            raise ValueError(f"extend must leave the buffer under lookahead={self.lookahead} pieces, got "
                             f"{len(pieces)} pieces onto {len(self._buffer)}; push them one by one")
        for piece in pieces:
            if not 0 < piece.end - piece.start <= self.seq_len:
                raise ValueError(f"piece.length must be in [1, seq_len={self.seq_len}], got {piece.length!r}")
        self._buffer += pieces
        self._state = None

    def flush(self) -> list[Row]:
        return self._pack(final=True)

    @property
    def room(self) -> int:
        """How many pieces the buffer takes before the next one packs it."""
        return self.lookahead - len(self._buffer)

    @property
    def pending_pieces(self) -> int:
        return len(self._buffer) + sum(len(b.pieces) for b in self._bins.values())

    def _pack(self, *, final: bool) -> list[Row]:
        items = sorted(self._buffer, key=lambda p: (-p.length, p.seq, p.start))
        self._buffer = []
        self._state = None
        # (room left, bin id), sorted: bisect finds the tightest bin that fits; ties go to the older bin.
        rooms = sorted((self.seq_len - b.used, b.id) for b in self._bins.values())
        closed: list[_Bin] = []
        rows: list[Row] = []
        for item in items:
            if item.length == self.seq_len:  # a row by itself: no open bin is empty
                rows.append([item])
                continue
            i = bisect.bisect_left(rooms, (item.length, -1))
            if i < len(rooms):
                room, bin_id = rooms.pop(i)
                b = self._bins[bin_id]
            else:
                b = self._bins[self._next_bin] = _Bin(self._next_bin)
                self._next_bin += 1
                room = self.seq_len
            b.pieces.append(item)
            b.used += item.length
            room -= item.length
            if room == 0:
                closed.append(self._bins.pop(b.id))
            else:
                bisect.insort(rooms, (room, b.id))
        # Keep the emptiest bins open (the next buffer's largest pieces fill them); emit the rest.
        keep = 0 if final else self.max_open_bins
        by_room = sorted(self._bins.values(), key=lambda b: (b.used, b.id))
        for n, b in enumerate(by_room):
            if n >= keep or b.age >= self.max_bin_age:
                closed.append(self._bins.pop(b.id))
            else:
                b.age += 1
        rows += [sorted(b.pieces, key=lambda p: (p.seq, p.start)) for b in closed]
        rows.sort(key=lambda r: (r[0].seq, r[0].start))
        return rows

    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            self._state = {
                "buffer": [p.to_list() for p in self._buffer],
                "bins": [[b.id, b.age, [p.to_list() for p in b.pieces]] for b in self._bins.values()],
                "next_bin": self._next_bin,
            }
        return {"buffer": list(self._state["buffer"]), "bins": list(self._state["bins"]),
                "next_bin": self._state["next_bin"]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._buffer = [Piece.from_list(p) for p in state["buffer"]]
        self._bins = {}
        for bin_id, age, pieces in state["bins"]:
            self._bins[int(bin_id)] = _Bin(int(bin_id), [Piece.from_list(p) for p in pieces], int(age))
        self._next_bin = int(state["next_bin"])
        self._state = None


def pack(
    lengths: Iterable[int],
    seq_len: int,
    *,
    policy: str = SPLIT,
    lookahead: int = 512,
    max_open_bins: int = 16,
    max_bin_age: int = 4,
) -> list[Row]:
    """Pack documents of the given lengths (document i has id i) into rows: the pure-function form."""
    check_policy("policy", policy)
    packer = BFDPacker(seq_len, lookahead=lookahead, max_open_bins=max_open_bins, max_bin_age=max_bin_age)
    rows: list[Row] = []
    for doc, n in enumerate(lengths):
        for piece in split_document(doc, int(n), seq_len, policy, seq=doc):
            rows += packer.push(piece)
    return rows + packer.flush()


def compact_batch(
    rows: Sequence[Sequence[Piece]],
    tokens_of: Callable[[int], np.ndarray],
    seq_len: int,
    *,
    batch_size: int | None = None,
    pad_id: int = 0,
    dtype: Any = np.int64,
) -> dict[str, np.ndarray]:
    """A batch of packed rows in its smallest form: the tokens plus one entry per segment.

    Rows beyond `len(rows)` up to `batch_size` are padding. `tokens_of(doc)` returns the whole
    document's tokens. Returns `input_ids` (batch_size, seq_len) of `dtype`, and per segment (every
    piece, and the padding at the end of a row): `seg_doc` (doc id, -1 for padding), `seg_len` and
    `seg_last_label` (the label of the segment's last token: the document's next token for a cut
    piece, else -100). `expand_batch` turns it into the training arrays; the loader's workers send
    this form, a fifth of the bytes.
    """
    batch_size = len(rows) if batch_size is None else batch_size
    if len(rows) > batch_size:
        raise ValueError(f"rows must number at most batch_size={batch_size}, got {len(rows)!r}")
    input_ids = np.empty((batch_size, seq_len), dtype=dtype)  # every slot is written once: a piece or padding
    seg_doc: list[int] = []
    seg_len: list[int] = []
    seg_last: list[int] = []
    for r in range(batch_size):
        off, out = 0, input_ids[r]
        for p in rows[r] if r < len(rows) else ():
            toks = tokens_of(p.doc)
            start, end = p.start, p.end
            n = end - start
            if off + n > seq_len:
                raise ValueError(f"row {r} holds more than seq_len={seq_len} tokens")
            out[off : off + n] = toks[start:end]
            seg_doc.append(p.doc)
            seg_len.append(n)
            # a cut piece: its last token predicts the document's next token (same document)
            seg_last.append(int(toks[end]) if end < p.doc_len else IGNORE_INDEX)
            off += n
        if off < seq_len:
            out[off:] = pad_id
            seg_doc.append(-1)
            seg_len.append(seq_len - off)
            seg_last.append(IGNORE_INDEX)
    return {"input_ids": input_ids, "seg_doc": np.array(seg_doc, dtype=np.int64),
            "seg_len": np.array(seg_len, dtype=np.int64), "seg_last_label": np.array(seg_last, dtype=np.int64)}


def expand_batch(input_ids: np.ndarray, seg_doc: np.ndarray, seg_len: np.ndarray,
                 seg_last_label: np.ndarray) -> dict[str, np.ndarray]:
    """The training arrays of a `compact_batch`: `input_ids`, `labels`, `position_ids`, `doc_ids`,
    `segment_ids` (int64, shape (batch_size, seq_len)) and `cu_seqlens` (int32, the segment
    boundaries of the flattened batch, so `cu_seqlens[-1] == batch_size * seq_len`).

    `segment_ids` numbers the segments of the flattened batch (segment i is
    [cu_seqlens[i], cu_seqlens[i + 1])): the attention segments, distinct even where two copies of
    one document sit side by side with equal `doc_ids`."""
    shape = input_ids.shape
    ids = np.ascontiguousarray(input_ids.reshape(-1), dtype=np.int64)  # the loader's own int64 batch is not copied
    seg_doc, seg_len, seg_last_label = (np.ascontiguousarray(a, dtype=np.int64)
                                        for a in (seg_doc, seg_len, seg_last_label))
    if len(seg_len) != len(seg_doc) or len(seg_len) != len(seg_last_label):
        raise ValueError(f"seg_doc, seg_len and seg_last_label must have one entry per segment, got "
                         f"{len(seg_doc)}, {len(seg_len)} and {len(seg_last_label)}")
    if seg_len.sum() != ids.size:
        raise ValueError(f"seg_len must sum to input_ids.size={ids.size}, got {int(seg_len.sum())!r}")
    if (seg_len < 1).any():  # an empty segment has no last token to label
        raise ValueError(f"seg_len must be positive, got {int(seg_len.min())!r}")
    labels, position_ids, doc_ids, segment_ids = (np.empty(ids.size, dtype=np.int64) for _ in range(4))
    cu = np.empty(len(seg_len) + 1, dtype=np.int32)
    kernels.expand(ids, seg_doc, seg_len, seg_last_label, labels, position_ids, doc_ids, segment_ids, cu)
    return {"input_ids": ids.reshape(shape), "labels": labels.reshape(shape), "position_ids": position_ids.reshape(shape),
            "doc_ids": doc_ids.reshape(shape), "segment_ids": segment_ids.reshape(shape), "cu_seqlens": cu}


def build_batch(
    rows: Sequence[Sequence[Piece]],
    tokens_of: Callable[[int], np.ndarray],
    seq_len: int,
    *,
    batch_size: int | None = None,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """The training arrays for a batch of packed rows (see `compact_batch` and `expand_batch`)."""
    return expand_batch(**compact_batch(rows, tokens_of, seq_len, batch_size=batch_size, pad_id=pad_id))


def segment_ids_of(cu_seqlens: torch.Tensor, seq_len: int, batch_size: int | None = None) -> torch.Tensor:
    """The per-token segment index (batch, seq_len) of a packed batch from its `cu_seqlens`.

    Token t of the flattened batch is in segment i when cu_seqlens[i] <= t < cu_seqlens[i + 1]
    (the loader's `segment_ids`). Give `batch_size` to skip reading cu_seqlens[-1] (a device sync).
    """
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    if batch_size is None:
        total = int(cu_seqlens[-1])
        if total % seq_len:
            raise ValueError(f"cu_seqlens[-1] must be a multiple of seq_len={seq_len}, got {total!r}")
        batch_size = total // seq_len
    pos = torch.arange(batch_size * seq_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), pos, right=True).view(batch_size, seq_len)


def block_causal_mask(segments: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    """The dense attention mask of packed rows: True where query i may attend key j.

    `segments` is either the batch's `segment_ids` of shape (batch, seq_len) or its `cu_seqlens`
    (1-D, over the flattened batch, with `seq_len` given); never `doc_ids`, which repeat when one
    document is drawn twice into a row. A query attends a key when both lie in the same segment
    and the key is not later. Padding forms its own segment, so no row of the mask is empty (an
    empty row would make softmax produce NaN). Returns a bool tensor of shape (batch, seq_len, seq_len).
    """
    if segments.dim() == 1:
        if seq_len is None or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer with cu_seqlens, got {seq_len!r}")
        seg = segment_ids_of(segments, seq_len)
    elif segments.dim() == 2:
        if seq_len is not None and segments.shape[1] != seq_len:
            raise ValueError(f"segment_ids must have seq_len={seq_len} columns, got shape {tuple(segments.shape)!r}")
        seg = segments
    else:
        raise ValueError(f"segments must be segment_ids (2-D) or cu_seqlens (1-D), got {segments.dim()!r} dimensions")
    n = seg.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    return (seg[:, :, None] == seg[:, None, :]) & causal


def select_rows(batch: Mapping[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `rows` (a 1-D index tensor) of a packed batch as a batch of their own.

    Every per-token tensor (batch_size, seq_len) is indexed; the attention segments are renumbered for
    the new rows: `segment_ids` counts them from 0 and `cu_seqlens` holds their boundaries in the new
    flattened batch. A segment never spans two rows and segment ids are distinct across rows, so a new
    segment starts exactly where the id changes along the selected rows."""
    out = {key: value[rows] for key, value in batch.items() if key != "cu_seqlens"}
    seg = out["segment_ids"].reshape(-1)
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[1:] = seg[1:] != seg[:-1]
    out["segment_ids"] = (torch.cumsum(starts, 0) - 1).view(out["input_ids"].shape)
    bounds = torch.nonzero(starts).reshape(-1)
    end = torch.tensor([seg.numel()], device=seg.device, dtype=bounds.dtype)
    out["cu_seqlens"] = torch.cat([bounds, end]).to(torch.int32)
    return out
