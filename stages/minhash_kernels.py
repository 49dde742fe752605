"""The compiled loops of `stages.minhash` (numba): a batch's words, shingles and signatures, one pass each,
where numpy needs several passes per step, each with a temporary the size of the batch.

Each is the exact equivalent of a formula `stages.minhash` states (its tests check them against pure-Python
references and datasketch): only speed depends on this module. Compiled on first use and cached next to this
file (numba's `cache=True`, like Python's own `__pycache__`), so a later process loads them instead.
"""

from __future__ import annotations

import numpy as np

from datapipe.core.compiled import compiled as _compiled


# MurmurHash3's finalizer, as `stages.minhash.fmix` has it (which cannot lend its table: it must not import numba)
_FMIX64 = (np.uint64(33), np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))
_FMIX32 = (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35))
_POWERS = 256  # a word's first bytes: their powers of the byte multiplier by table
_REPLACEMENT = 0xFFFD  # the character a malformed or cut UTF-8 sequence stands for (never a word character)


@_compiled(inline="always")
def _fmix64(h: np.uint64) -> np.uint64:
    shift, m1, m2 = _FMIX64
    h ^= h >> shift
    h *= m1
    h ^= h >> shift
    h *= m2
    return h ^ (h >> shift)


@_compiled(inline="always")
def _fmix32(h: np.uint32) -> np.uint32:
    s1, m1, s2, m2 = _FMIX32
    h ^= h >> s1
    h = np.uint32(h * m1)  # numba widens a product of uint32s: keep its low 32 bits
    h ^= h >> s2
    h = np.uint32(h * m2)
    return h ^ (h >> s1)


@_compiled(inline="always")
def _character(data: np.ndarray, i: int, end: int) -> tuple[int, int]:
    """(the code point of the UTF-8 character at data[i], its size in bytes); a stray continuation byte or a
    sequence cut by `end` is one `_REPLACEMENT` per byte."""
    b0 = int(data[i])
    if b0 < 0x80:
        return b0, 1
    if b0 < 0xC0:
        return _REPLACEMENT, 1
    size = 2 if b0 < 0xE0 else 3 if b0 < 0xF0 else 4
    if i + size > end:
        return _REPLACEMENT, 1
    cp = b0 & (0x7F >> size)
    for k in range(1, size):
        cp = (cp << 6) | (int(data[i + k]) & 0x3F)
    return (cp if cp <= 0x10FFFF else _REPLACEMENT), size


@_compiled(inline="always")
def _add_byte(acc: np.uint64, length: int, power: np.uint64, byte: np.uint8, powers: np.ndarray,
              byte_poly: np.uint64) -> tuple[np.uint64, int, np.uint64]:
    """A word's sum with its next byte: `acc + byte * byte_poly**length`, the power looked up while the word
    is shorter than the table (no chain of multiplies from byte to byte), multiplied on beyond it."""
    power = powers[length] if length < len(powers) else power * byte_poly
    return acc + np.uint64(byte) * power, length + 1, power


@_compiled()
def word_hashes(data: np.ndarray, text_offsets: np.ndarray, is_word: np.ndarray, byte_poly: np.uint64,
                length_mix: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """(the hash of every word of every text, in order; the number of words of each text). Text t is
    data[text_offsets[t]:text_offsets[t + 1]] (UTF-8); a word is a maximal run of characters c with is_word[c];
    its hash is `fmix64(sum(w[j] * byte_poly**j) + len(w) * length_mix)` over its bytes w (mod 2**64)."""
    powers = np.empty(_POWERS, dtype=np.uint64)
    powers[0] = 1
    for j in range(1, _POWERS):
        powers[j] = powers[j - 1] * byte_poly
    texts = len(text_offsets) - 1
    out = np.empty((len(data) + texts) // 2 + 1, dtype=np.uint64)  # a word and the character after it: 2 bytes
    counts = np.zeros(texts, dtype=np.int64)
    words = 0
    for t in range(texts):
        i, end, before = text_offsets[t], text_offsets[t + 1], words
        acc, length, power = np.uint64(0), 0, np.uint64(1)
        while i < end:
            if data[i] < 0x80:  # most text: a character of one byte
                if is_word[data[i]]:
                    acc, length, power = _add_byte(acc, length, power, data[i], powers, byte_poly)
                    i += 1
                    continue
                size = 1
            else:
                cp, size = _character(data, i, end)
                if is_word[cp]:
                    for k in range(i, i + size):
                        acc, length, power = _add_byte(acc, length, power, data[k], powers, byte_poly)
                    i += size
                    continue
            if length:
                out[words] = _fmix64(acc + np.uint64(length) * length_mix)
                words += 1
                acc, length = np.uint64(0), 0
            i += size
        if length:
            out[words] = _fmix64(acc + np.uint64(length) * length_mix)
            words += 1
        counts[t] = words - before
    return out[:words], counts


@_compiled()
def window_hashes(unit_hashes: np.ndarray, unit_counts: np.ndarray, n: int, poly: np.uint64) -> np.ndarray:
    """The hash of every window of n consecutive unit hashes inside each document (documents are consecutive
    runs of `unit_counts` units; one shorter than n has one window of all its units, an empty one none):
    `sum(h[j] * poly**(size - 1 - j))` over the window's hashes h (mod 2**64), in document order."""
    total = 0
    for count in unit_counts:
        total += count - n + 1 if count >= n else min(count, 1)
    out = np.empty(total, dtype=np.uint64)
    start, w = 0, 0
    for count in unit_counts:
        size = min(n, count)
        for first in range(start, start + max(count - n + 1, min(count, 1))):
            acc = np.uint64(0)
            for j in range(first, first + size):
                acc = acc * poly + unit_hashes[j]
            out[w] = acc
            w += 1
        start += count
    return out


@_compiled()
def permuted_minimum(hashes64: np.ndarray, counts: np.ndarray, a: np.ndarray, b: np.ndarray, high: bool) -> np.ndarray:
    """(documents, permutations) uint32: per document (a run of `counts` shingle hashes) and permutation p,
    the minimum over its shingles of `a[p] * fmix32(h) + b[p] mod 2**32`, h being the top 32 bits of the
    shingle's 64-bit hash (`high`) or the low 32; 2**32 - 1 for a document without shingles."""
    perms = len(a)
    sig = np.full((len(counts), perms), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    start = 0
    for d in range(len(counts)):
        row = sig[d]
        for j in range(start, start + counts[d]):
            x = _fmix32(np.uint32(hashes64[j] >> np.uint64(32)) if high else np.uint32(hashes64[j] & np.uint64(0xFFFFFFFF)))
            for p in range(perms):
                row[p] = min(row[p], np.uint32(a[p] * x + b[p]))
        start += counts[d]
    return sig


@_compiled()
def sorted_intersections(values: np.ndarray, offsets: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """For each pair i, the size of the intersection of the sets `left[i]` and `right[i]`; set s is
    values[offsets[s]:offsets[s + 1]], sorted and distinct (one merge of the two)."""
    out = np.zeros(len(left), dtype=np.int64)
    for k in range(len(left)):
        i, i_end = offsets[left[k]], offsets[left[k] + 1]
        j, j_end = offsets[right[k]], offsets[right[k] + 1]
        common = 0
        while i < i_end and j < j_end:
            x, y = values[i], values[j]
            common += x == y
            i += x <= y
            j += y <= x
        out[k] = common
    return out
