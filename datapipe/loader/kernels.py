"""The loader's compiled loops (numba): drawing units into the packer's buffer, and a compact batch's training arrays.

Each is the exact equivalent of Python the loader keeps: `draw_units` of the planner's one-unit step
(`Planner._advance`, which still takes every unit these loops stop at), `expand` of `packing.expand_batch`'s
formulas; the tests compare them. Only speed depends on this module. Compiled on first use and cached next to
this file (numba's `cache=True`), so a later process loads them instead.
"""

from __future__ import annotations

import numpy as np

from datapipe.core.compiled import compiled as _compiled

IGNORE_INDEX = -100  # packing.IGNORE_INDEX (packing imports this module, so the value is written twice)
SPLIT, TRUNCATE, DROP = 0, 1, 2  # the long-document policies, by code
# what `draw_units` counts, in the order of its `counts` array
COUNTS = ("tokens_drawn", "epoch_tokens", "next_seq", "docs_drawn", "docs_split", "docs_truncated", "docs_dropped",
          "tokens_dropped", "pieces")


@_compiled(inline="always")
def _choose(cand: np.ndarray, credit: np.ndarray, served: np.ndarray) -> int:
    """`schedule.DeficitSampler.choose`: the candidate whose served tokens lag its credit most (ties: the first)."""
    best, best_lag = -1, -np.inf
    for d in range(len(cand)):
        if cand[d]:
            lag = credit[d] - served[d]
            if lag > best_lag:
                best, best_lag = d, lag
    return best


@_compiled(inline="always")
def _piece_count(n: int, start: int, end: int, seq_len: int, policy: int) -> int:
    """How many pieces `packing.split_document` makes of a unit; -1 where it would raise (the caller's Python
    step then raises its error)."""
    if (start != 0 or end != n) and (policy != SPLIT or start % seq_len != 0 or not 0 <= start < end <= n):
        return -1
    if n <= seq_len or policy == TRUNCATE:
        return 1
    if policy == DROP:
        return 0
    return (end - start + seq_len - 1) // seq_len


@_compiled()
def draw_units(units: np.ndarray, first: np.ndarray, avail: np.ndarray, ends_window: np.ndarray, cand: np.ndarray,
               share: np.ndarray, policy: np.ndarray, credit: np.ndarray, served: np.ndarray, used: np.ndarray,
               counts: np.ndarray, pieces: np.ndarray, seq_len: int, world: int, steady_until: float,
               epoch_target: int) -> None:
    """Draw units as `Planner._advance` does, one after another, while nothing but this arithmetic decides them.

    Domain d's next units are rows first[d]:first[d] + avail[d] of `units` ([doc, length, start, end]); `cand`
    marks the domains the sampler may choose (eligible, weight > 0), each credited `share` of every kept token.
    Stops before a unit that needs the Python step: a weight change (`steady_until` global tokens), the epoch's
    end (`epoch_target` tokens; -1 in epoch mode, where a domain's end stops it), a domain chosen without units
    here, a unit whose pieces would fill the packer's buffer (`len(pieces)` is the room left), or one that
    `split_document` refuses. Stops after a domain's last unit of its window (`ends_window`): what comes next
    is the Python's to decide. `credit`, `served`, `used` (units taken per domain), `counts` (see COUNTS) and
    `pieces` ([doc, start, end, doc_len, tag, seq], `counts[-1]` of them) are updated in place.
    """
    while True:
        if epoch_target >= 0 and counts[1] >= epoch_target:
            break
        if counts[0] * world >= steady_until:
            break
        d = _choose(cand, credit, served)
        if d < 0 or used[d] >= avail[d]:
            break
        row = first[d] + used[d]
        doc, n, start, end = units[row, 0], units[row, 1], units[row, 2], units[row, 3]
        k = _piece_count(n, start, end, seq_len, policy[d])
        if k < 0 or counts[8] + k >= len(pieces):
            break
        kept = 0
        for j in range(k):
            lo, hi = (0, n) if n <= seq_len else ((0, seq_len) if policy[d] == TRUNCATE else
                                                 (start + j * seq_len, min(start + (j + 1) * seq_len, end)))
            p = pieces[counts[8] + j]
            p[0], p[1], p[2], p[3], p[4], p[5] = doc, lo, hi, n, d, counts[2]
            kept += hi - lo
        counts[8] += k
        counts[2] += 1
        if start == 0:  # a document counts once: on its first chunk
            counts[3] += 1
            if n > seq_len:
                counts[4 + policy[d]] += 1
        counts[7] += end - start - kept
        for e in range(len(cand)):  # DeficitSampler.record
            if cand[e]:
                credit[e] += share[e] * kept
        served[d] += kept
        counts[0] += kept
        counts[1] += kept
        used[d] += 1
        if used[d] == avail[d] and ends_window[d]:
            break


@_compiled()
def expand(ids: np.ndarray, seg_doc: np.ndarray, seg_len: np.ndarray, seg_last_label: np.ndarray,
           labels: np.ndarray, position_ids: np.ndarray, doc_ids: np.ndarray, segment_ids: np.ndarray,
           cu: np.ndarray) -> None:
    """`packing.expand_batch`'s per-token arrays, written into the given arrays: one array at a time, each a
    plain fill of every segment that the compiler can vectorise."""
    t = 0
    for s in range(len(seg_len)):
        cu[s] = t
        t += seg_len[s]
    cu[len(seg_len)] = t
    for s in range(len(seg_len)):
        a = cu[s]
        for i in range(seg_len[s]):
            position_ids[a + i] = i
    for s in range(len(seg_len)):
        doc_ids[cu[s]:cu[s + 1]] = seg_doc[s]
    for s in range(len(seg_len)):
        segment_ids[cu[s]:cu[s + 1]] = s
    labels[:-1] = ids[1:]  # each token predicts the next inside its segment; the last one its own label
    for s in range(len(seg_len)):
        if seg_doc[s] < 0:  # padding predicts nothing
            labels[cu[s]:cu[s + 1]] = IGNORE_INDEX
        else:
            labels[cu[s + 1] - 1] = seg_last_label[s]
