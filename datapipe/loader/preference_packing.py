"""Preference packing: (prompt, chosen, rejected) token triples into rows for DPO.

A pair is stored as one *item*: its prompt once, then the chosen, then the
rejected response. Position ids restart at every item and both responses start right after the
prompt (chosen and rejected tokens at the same offset get the same position). The attention mask
lets a prompt token see earlier prompt tokens, and a response token see the prompt and earlier
tokens of its own response, never the other response nor another item. Items are packed several
per row by best-fit decreasing on their total length (an item longer than the row is dropped and
counted). The first token of each response is predicted from the last prompt token, so the
log-probability of response token i is read from the logits at `pred_index[i]` (i - 1 inside a
response, the prompt's last position for its first token), and `resp_id` (2 * pair + 0 for
chosen, + 1 for rejected, -1 elsewhere) sums them per response. Padded pairs (the usual DPO
collator: prompt+chosen and prompt+rejected as two rows, padded to the longest) use the same
builder with one response per item, which is how the benchmark compares them.

Every item needs a prompt of at least one token: a response's first token is predicted from the
prompt's last position, which an empty prompt does not have (it would read the previous item's
response, or column -1). Curation quarantines such records; `load_pairs` and `build_rows` refuse them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError


def load_pairs(source: str | Path) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every (prompt, chosen, rejected) token triple of a preference folder, in manifest order."""
    manifest = shards.read_manifest(source)
    if manifest.get("kind") != "preference":
        raise ConfigError(f"data.source must be a preference folder (manifest kind 'preference'), got {str(source)!r} "
                          f"with kind {manifest.get('kind')!r}; curate one with `datapipe curate-preferences`")
    out = []
    for s in manifest["shards"]:
        t = shards.open_shard(str(source), s["path"])
        cols = [t.column(c).to_pylist() for c in ("prompt_tokens", "chosen_tokens", "rejected_tokens")]
        for doc_id, trip in zip(t.column("id").to_pylist(), zip(*cols)):
            if not trip[0]:
                raise ConfigError(f"{source}: pair {doc_id!r} in {s['path']} has an empty prompt; DPO needs a prompt token to "
                                  "predict each response from (re-curate with `datapipe curate-preferences`, which quarantines it)")
            out.append(tuple(np.asarray(x, dtype=np.int64) for x in trip))
    return out


# ------------------------------------------------------------------------------------------- packing


def pack_items(lengths: Sequence[int], seq_len: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing of items (by total length) into rows of seq_len: (rows of item indices, dropped)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    dropped = []
    for i in order:
        n = lengths[i]
        if n > seq_len:
            dropped.append(i)
            continue
        best = -1
        for r, free in enumerate(room):  # fewest free slots that still fit
            if free >= n and (best < 0 or free < room[best]):
                best = r
        if best < 0:
            rows.append([i])
            room.append(seq_len - n)
        else:
            rows[best].append(i)
            room[best] -= n
    return [sorted(r) for r in rows], dropped


def build_rows(rows: Sequence[Sequence[tuple[np.ndarray, list[np.ndarray], list[int]]]], seq_len: int,
               pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Tensors for rows of items; an item is (prompt, responses, response ids): see the module docstring.

    Returns input_ids, position_ids, pred_index, resp_id (B, S) and attn_mask (B, S, S) with
    True where attention is allowed.
    """
    B = len(rows)
    ids = np.full((B, seq_len), pad_id, dtype=np.int64)
    pos = np.zeros((B, seq_len), dtype=np.int64)
    pred = np.zeros((B, seq_len), dtype=np.int64)
    resp = np.full((B, seq_len), -1, dtype=np.int64)
    item = np.full((B, seq_len), -1, dtype=np.int64)
    part = np.zeros((B, seq_len), dtype=np.int64)
    for b, row in enumerate(rows):
        at = 0
        for k, (prompt, responses, rids) in enumerate(row):
            P = len(prompt)
            if P == 0:
                raise ValueError(f"item {k} of row {b} (response ids {list(rids)}) has an empty prompt: its responses "
                                 "would be predicted from another item's tokens; every pair needs a prompt of >= 1 token")
            ids[b, at : at + P] = prompt
            pos[b, at : at + P] = np.arange(P)
            item[b, at : at + P] = k
            last_prompt = at + P - 1
            at += P
            for j, (r, rid) in enumerate(zip(responses, rids)):
                n = len(r)
                ids[b, at : at + n] = r
                pos[b, at : at + n] = P + np.arange(n)
                item[b, at : at + n] = k
                part[b, at : at + n] = 1 + j
                resp[b, at : at + n] = rid
                pred[b, at : at + n] = np.arange(at - 1, at + n - 1)
                pred[b, at] = last_prompt  # a response's first token is predicted from the prompt's end
                at += n
        if at > seq_len:
            raise ValueError(f"a row holds {at} tokens, more than seq_len={seq_len}")
        item[b, at:] = -2 - np.arange(seq_len - at)  # each padding token its own item: it sees only itself
    it, pt = torch.from_numpy(item), torch.from_numpy(part)
    idx = torch.arange(seq_len)
    causal = idx[None, :, None] >= idx[None, None, :]
    same = it[:, :, None] == it[:, None, :]
    visible = (pt[:, None, :] == 0) | (pt[:, None, :] == pt[:, :, None])  # the key is prompt or the query's own part
    mask = causal & same & visible
    return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos), "pred_index": torch.from_numpy(pred),
            "resp_id": torch.from_numpy(resp), "attn_mask": mask}


def packed_batches(pairs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], order: Sequence[int], seq_len: int,
                   rows_per_batch: int, *, packed: bool = True, chunk: int = 256) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """(batch, pairs in it) over `order`: packed (pairs best-fit into rows) or padded (two rows per pair,
    padded to the batch's longest). Pairs are taken `chunk` at a time; a pair that cannot fit is dropped."""
    order = list(order)
    for c0 in range(0, len(order), chunk):
        part = order[c0 : c0 + chunk]
        if packed:
            lens = [sum(len(x) for x in pairs[i]) for i in part]
            rows, _ = pack_items(lens, seq_len)
            rows = [[part[k] for k in r] for r in rows]
            for b0 in range(0, len(rows), rows_per_batch):
                group = rows[b0 : b0 + rows_per_batch]
                items, n = [], 0
                for r in group:
                    row = []
                    for i in r:
                        p, c, rj = pairs[i]
                        row.append((p, [c, rj], [2 * n, 2 * n + 1]))
                        n += 1
                    items.append(row)
                yield build_rows(items, seq_len), n
        else:
            keep = [i for i in part if len(pairs[i][0]) + max(len(pairs[i][1]), len(pairs[i][2])) <= seq_len]
            per = max(1, rows_per_batch // 2)
            for b0 in range(0, len(keep), per):
                group = keep[b0 : b0 + per]
                items = []
                for n, i in enumerate(group):
                    p, c, rj = pairs[i]
                    items += [[(p, [c], [2 * n])], [(p, [rj], [2 * n + 1])]]
                longest = max(len(pairs[i][0]) + max(len(pairs[i][1]), len(pairs[i][2])) for i in group)
                yield build_rows(items, longest), len(group)
