r"""Near-duplicate removal with MinHash-LSH: the pure parts (the curation phases distribute them).

1. **Signatures**, a batch at a time. Each document's shingles (word n-grams of the lowercased
   text, or character n-grams; words are `\w+` runs, or with `words: whitespace` those of
   `str.split()`) are hashed to 64 bits, and the 32 bits datasketch
   would see go through datasketch's own permutations (its `affine32` scheme: the MurmurHash3
   finalizer, then `a * h + b mod 2**32`, with `a, b` drawn from `np.random.RandomState(seed)`
   exactly as `datasketch.MinHash` draws them); the signature is the per-permutation minimum,
   computed by compiled loops over all shingles of a batch (`stages.minhash_kernels`, numba), never
   one Python object per document.
   With `hash: sha1` the 32-bit shingle hash is datasketch's default (`sha1_hash32` of the UTF-8
   shingle), so the signatures equal `datasketch.MinHash(num_perm, seed).update(shingle)` exactly;
   `hash: xxh3` hashes each word (or character) once and combines n of them polynomially, which
   is several times faster and equals `datasketch.MinHash(..., hashfunc=shingle_hash32)`. The
   default `hash: vector` sees the same words but runs no Python per word: the words of a whole
   batch are found and hashed in one compiled pass over its UTF-8 bytes, each as a byte polynomial
   (`vector_word_hash`), then combined into shingles as `xxh3` combines its word hashes (for
   `shingle: char` the two are the same hash).
2. **LSH**: `bands × rows` of the signature; each band's rows hash to a bucket key. Unless given,
   they are derived from `candidate_recall`: the steepest banding (most rows) whose probability of
   making a pair at exactly the threshold a candidate, `1 - (1 - t**rows)**bands`, reaches it, with
   the fewest bands that do (`lsh_params`). Documents sharing a bucket are candidates.
3. **Verification** (`verify`): within a bucket (members in input order) every member is paired with
   up to `bucket_window` members before it — every pair of a bucket of up to `bucket_window + 1`
   documents, and bounded work in a huge one. A candidate pair is an edge when its Jaccard reaches
   the threshold: by the signature's estimate (the fraction of equal values) when that is more than
   `exact_margin` away from the threshold, else by the exact Jaccard of the two documents' sets of
   64-bit shingle hashes, recomputed from their text (`shingle_sets`). The map side keeps per document
   its bucket keys and its signature once, at `SIGNATURE_BITS` a value (`MinHashStage.keys`).
4. **Connected components** over the edges by alternating *large-star* and *small-star*
   rounds (Kiveris et al., "Connected Components in MapReduce and Beyond", 2014). Each round is a
   pure function of the edges of one hash partition of nodes, so the run runs a round as one task
   per partition with memory bounded by the partition count, not by the corpus. At convergence each
   node is linked to the smallest node of its component — the first document by input order.
5. **One document kept per cluster** (`first` by input order, or `longest` with ties to the first);
   every other member is dropped with reason `near_duplicate` and the id of the document kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import re
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from datapipe.core.config import check, note
from stages.base import LOSER_SCHEMA, utf8_bytes

MIN_PARTITIONS = 16  # `partitions: auto` never goes below this (tasks enough for a few dozen workers)
# The smallest margin whose decisions on the shared corpus equal deciding every candidate by its exact Jaccard, at
# the default threshold and permutations; a narrower one loses true pairs and keeps false ones, a wider one only
# reads more text (scripts/bench_exact_margin, BENCHMARKS.md "The exact check's margin")
EXACT_MARGIN = 0.12
_POLY = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier for combining unit hashes into a shingle hash
_U64 = np.uint64

# MurmurHash3's finalizer constants (shift, multiplier, shift, multiplier, shift) by width.
_FMIX = {
    32: (np.uint32, (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)),
    64: (np.uint64, (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)),
}


def fmix(values: np.ndarray, width: Literal[32, 64]) -> np.ndarray:
    """MurmurHash3's finalizer, element-wise on uint32 (width 32) or uint64 (width 64) values: a
    bijection that spreads every input bit over the output. datasketch's `MinHash` applies the same
    function to each hash before its permutations; we use it for that and as a general mixer."""
    dtype, (s1, m1, s2, m2, s3) = _FMIX[width]
    h = values.astype(dtype, copy=False)
    with np.errstate(over="ignore"):
        h = h ^ (h >> dtype(s1))
        h = h * dtype(m1)  # wraps mod 2**width, as intended
        h = h ^ (h >> dtype(s2))
        h = h * dtype(m2)
        return h ^ (h >> dtype(s3))


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """The probability that two documents of Jaccard `similarity` share at least one LSH bucket."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def recall_banding(threshold: float, num_perm: int, recall: float) -> tuple[int, int]:
    """(bands, rows) for which a pair at exactly `threshold` is a candidate with probability
    >= `recall`: the most rows per band that some bands x rows <= num_perm reaches it with (a
    steeper curve: fewer candidates below the threshold), and the fewest bands that do. Falls back
    to one row per band (num_perm bands) when nothing reaches it."""
    for rows in range(num_perm, 0, -1):
        p = threshold**rows
        # the fewest bands b with 1 - (1 - p)**b >= recall
        bands = 1 if p >= recall else math.ceil(math.log1p(-recall) / math.log1p(-p) - 1e-12)
        if bands * rows <= num_perm:
            return bands, rows
    return num_perm, 1


@dataclass(frozen=True, kw_only=True)
class MinHashConfig:
    enabled: bool = note(False, help="remove near-duplicates globally with MinHash-LSH")
    shingle: Literal["word", "char"] = note("word", help="shingle unit: word n-grams or character n-grams")
    ngram: int = note(5, help="shingle size in units")
    lowercase: bool = note(True, help="lowercase the text before shingling")
    words: Literal["alnum", "whitespace"] = note(
        "alnum",
        help="what a word is (shingle: word): alnum = the runs of letters, digits and _ (Python's `\\w+`: punctuation "
        "separates words and is not part of them, as datatrove's text simplification removes it), so `end.` and "
        "`end` are one word; whitespace = `str.split()`, the rule before (punctuation is part of a word)",
    )
    num_perm: int = note(128, help="number of permutations (signature length)")
    threshold: float = note(0.8, help="Jaccard similarity from which documents count as near-duplicates")
    candidate_recall: float = note(
        0.99,
        help="probability that a pair at exactly the threshold shares an LSH bucket; bands x rows are derived "
        "from it (the most rows, then the fewest bands, that reach it: 16 x 6 for 0.99 with 128 permutations at "
        "0.8; datasketch's balanced 9 x 13 gives 0.40). Measured against brute force on planted and natural "
        "near-duplicates (BENCHMARKS.md): 0.99 gives pair precision and recall 1.000 (0.9: recall 0.992; the "
        "previous default 9 x 13 without exact checks: 0.872)",
    )
    bands: int | None = note(None, help="LSH bands; null = derived from candidate_recall (give both bands and rows, or neither)")
    rows: int | None = note(None, help="rows per band; null = derived from candidate_recall")
    seed: int = note(1, help="seed of the permutations (datasketch's MinHash seed)")
    hash: Literal["vector", "xxh3", "sha1"] = note(
        "vector",
        help="shingle hash: vector (the fastest: words found and hashed in one compiled pass over a batch's bytes, "
        "stages.minhash.vector_word_hash), xxh3 (each word's xxh3-64 in Python) or sha1 (datasketch's default); "
        "all three see the same words. With shingle: char, vector and xxh3 are the same hash",
    )
    verify: bool = note(
        True, help="keep a candidate pair only if its Jaccard reaches the threshold (estimated, or exact near the threshold)"
    )
    exact_margin: float = note(
        EXACT_MARGIN,
        help="a candidate whose estimated Jaccard is within this of the threshold is decided by the exact Jaccard "
        "of the two documents' shingle sets (0 = by the estimate alone; the estimate's standard error at 0.8 with "
        "128 permutations is 0.035). The default is measured against brute force at threshold 0.8 with 128 "
        "permutations (BENCHMARKS.md); a lower threshold wants a wider margin, a higher one or more permutations "
        "a narrower one: measure yours with scripts/bench_exact_margin --threshold --num-perm",
    )
    bucket_window: int = note(
        32,
        help="verify each member of an LSH bucket against up to this many members before it (input order): every "
        "pair of buckets of up to window+1 documents, bounded work in larger ones",
    )
    keep: Literal["first", "longest"] = note("first", help="which document of a cluster is kept")
    partitions: int | Literal["auto"] = note(
        "auto",
        help="hash partitions for the bucket shuffle and the connected-components rounds; auto = from the input's size, "
        "so that no partition's task needs more than ray.task_memory_gib (at least 16); the output does not depend on it",
    )
    one_task_edges: int = note(
        1_000_000,
        help="find the connected components in one task, in memory (at most ~300 bytes per edge), when there are "
        "at most this many edges; above, in distributed rounds of one task per partition (the same result)",
    )
    max_rounds: int = note(64, help="give up (an error) after this many connected-components rounds")

    def __post_init__(self) -> None:
        check(self.ngram >= 1, f"ngram must be >= 1, got {self.ngram!r}")
        check(1 <= self.num_perm <= 1024, f"num_perm must be in [1, 1024], got {self.num_perm!r}")
        check(0.0 < self.threshold < 1.0, f"threshold must be in (0, 1), got {self.threshold!r}")
        check(0.0 < self.candidate_recall < 1.0, f"candidate_recall must be in (0, 1), got {self.candidate_recall!r}")
        check((self.bands is None) == (self.rows is None), "bands and rows must be given together, or neither")
        if self.bands is not None and self.rows is not None:
            check(self.bands >= 1 and self.rows >= 1, f"bands and rows must be >= 1, got {self.bands!r} x {self.rows!r}")
            check(self.bands * self.rows <= self.num_perm,
                  f"bands x rows must be <= num_perm ({self.num_perm}), got {self.bands} x {self.rows}")
        check(0.0 <= self.exact_margin <= 1.0, f"exact_margin must be in [0, 1], got {self.exact_margin!r}")
        check(self.bucket_window >= 1, f"bucket_window must be >= 1, got {self.bucket_window!r}")
        check(self.partitions == "auto" or self.partitions > 0, f"partitions must be > 0 or 'auto', got {self.partitions!r}")
        check(self.one_task_edges >= 0, f"one_task_edges must be >= 0, got {self.one_task_edges!r}")
        check(self.max_rounds > 1, f"max_rounds must be > 1, got {self.max_rounds!r}")

    def lsh_params(self) -> tuple[int, int]:
        """(bands, rows): as configured, or derived from `candidate_recall` (`recall_banding`)."""
        if self.bands is not None and self.rows is not None:
            return self.bands, self.rows
        return recall_banding(self.threshold, self.num_perm, self.candidate_recall)

    @property
    def exact(self) -> bool:
        """Whether candidates near the threshold are checked against their exact Jaccard."""
        return self.verify and self.exact_margin > 0


# ------------------------------------------------------------------------------------- shingles


_WORD = re.compile(r"\w+")


def _units(text: str, config: MinHashConfig) -> list[str] | str:
    if config.lowercase:
        text = text.lower()
    if config.shingle == "char":
        return text
    return _WORD.findall(text) if config.words == "alnum" else text.split()


def _char_hashes(text: str) -> np.ndarray:
    codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(_U64)
    return fmix(codepoints, 64)  # spread code points over 64 bits


def _word_hashes(words: list[str]) -> np.ndarray:
    """xxh3-64 of each word's UTF-8 bytes (`map` keeps the loop in C: 1.5x a generator)."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, map(str.encode, words)), dtype=_U64, count=len(words))


@functools.lru_cache(maxsize=1)
def _kernels():  # type: ignore[no-untyped-def]
    """`stages.minhash_kernels`, imported on first use: numba's import only in a process that hashes."""
    from stages import minhash_kernels

    return minhash_kernels


def _windows(unit_hashes: np.ndarray, counts: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of every window of n consecutive unit hashes inside each document (documents
    are consecutive runs of `counts` units; a document shorter than n has one window of all its
    units), in document order, then position order: `acc = acc * _POLY + h` over the window."""
    return _kernels().window_hashes(np.ascontiguousarray(unit_hashes, dtype=_U64), np.asarray(counts, dtype=np.int64), n, _POLY)


# ------------------------------------------------------------------------------------- hash: vector

_BYTE_POLY = _U64(0xC2B2AE3D27D4EB4F)  # odd: a word's bytes are the coefficients of a polynomial in it
_LENGTH_MIX = _U64(0x165667B19E3779F9)  # odd: times the length, which tells "a" from "a\0" (a zero byte adds 0)
# The characters `str.split()` splits on: none above U+FFFF (a test checks the whole range).
_WHITESPACE = "".join(chr(c) for c in range(0x10000) if chr(c).isspace())


def vector_word_hash(word: bytes) -> int:
    """The `hash: vector` hash of one word's UTF-8 bytes `w` (a reference; `_vector_units` computes
    it for every word of a batch at once): the polynomial `sum(w[j] * K**j) + len(w) * L mod 2**64`,
    K = 0xC2B2AE3D27D4EB4F, L = 0x165667B19E3779F9, through MurmurHash3's 64-bit finalizer (`fmix`)
    so that every byte reaches every output bit."""
    value = (sum(b * pow(int(_BYTE_POLY), j, 1 << 64) for j, b in enumerate(word)) + len(word) * int(_LENGTH_MIX)) % (1 << 64)
    return int(fmix(np.array([value], dtype=_U64), 64)[0])


def _lowered(texts: pa.Array) -> pa.Array:
    """`str.lower()` of every text. Arrow's `utf8_lower` maps each code point by itself, as Python
    does, but for two special cases of Python's, `İ` (to `i̇`) and `Σ` (to `ς` at the end of a word):
    the few texts holding either are lowered by Python. (Letters of a Unicode version newer than
    Python's are lowered by Arrow only: a test checks every code point.)"""
    lowered = pc.utf8_lower(texts)
    data, offsets = utf8_bytes(texts)
    # U+03A3 is CE A3 in UTF-8 and U+0130 is C4 B0; a lead byte never appears inside another character
    hit = np.flatnonzero((data == 0xA3) | (data == 0xB0))
    hit = hit[hit > 0]
    before = data[hit - 1]
    special = hit[((data[hit] == 0xA3) & (before == 0xCE)) | ((data[hit] == 0xB0) & (before == 0xC4))]
    if len(special) == 0:
        return lowered
    rows = np.unique(np.searchsorted(offsets, special, side="right") - 1)
    mask = np.zeros(len(texts), dtype=bool)
    mask[rows] = True
    by_python = pa.array([t.lower() for t in texts.take(pa.array(rows)).to_pylist()], lowered.type)
    return pc.replace_with_mask(lowered, pa.array(mask), by_python)


@functools.lru_cache(maxsize=2)
def _word_characters(words: Literal["alnum", "whitespace"] = "alnum") -> np.ndarray:
    """`is_word[code point]` for all of Unicode: the characters of Python's `\\w` (str.isalnum() or `_`) for
    `alnum`, every character but whitespace for `whitespace` (once per process)."""
    if words == "whitespace":
        table = np.ones(0x110000, dtype=bool)
        table[[ord(c) for c in _WHITESPACE]] = False
        return table
    table = np.zeros(0x110000, dtype=bool)
    every_character = np.arange(0x110000, dtype=np.uint32).tobytes().decode("utf-32-le", "surrogatepass")
    for m in _WORD.finditer(every_character):
        table[m.start() : m.end()] = True
    return table


def _vector_units(texts: pa.Array, lowercase: bool, words: Literal["alnum", "whitespace"] = "whitespace") -> tuple[np.ndarray, np.ndarray]:
    """(`vector_word_hash` of every word of every text, in order; the number of words of each text),
    the words being those of `_units` (`\\w+` or `str.split()` of the text, lowercased with `lowercase`):
    one compiled pass over the texts' UTF-8 bytes (`minhash_kernels.word_hashes`)."""
    data, text_offsets = utf8_bytes(_lowered(texts) if lowercase else texts)
    return _kernels().word_hashes(data, text_offsets, _word_characters(words), _BYTE_POLY, _LENGTH_MIX)


def shingle_hashes64(texts: list[str] | pa.Array, config: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit hashes of the shingles of all `texts`, concatenated; the number of each text's
    shingles). Duplicates are kept (a signature's minimum does not care). `hash: sha1` takes the
    first 8 bytes of each shingle's SHA-1, little-endian; `xxh3` combines the units' xxh3-64;
    `vector` combines the words' `vector_word_hash` in the same way."""
    if config.hash == "vector" and config.shingle == "word":
        arrow_texts = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.large_string())
        if isinstance(arrow_texts, pa.ChunkedArray):
            arrow_texts = arrow_texts.combine_chunks()
        unit_hashes, unit_counts = _vector_units(arrow_texts, config.lowercase, config.words)
        counts = np.where(unit_counts >= config.ngram, unit_counts - config.ngram + 1, (unit_counts > 0).astype(np.int64))
        return _windows(unit_hashes, unit_counts, config.ngram), counts
    if not isinstance(texts, list):
        texts = texts.to_pylist()
    if config.hash == "sha1":
        per_doc = [shingles(t, config) for t in texts]
        counts = np.fromiter(map(len, per_doc), dtype=np.int64, count=len(texts))
        digests = (hashlib.sha1(s).digest()[:8] for s in itertools.chain.from_iterable(per_doc))
        return np.frombuffer(b"".join(digests), dtype="<u8").astype(_U64), counts
    units = [_units(t, config) for t in texts]
    unit_counts = np.fromiter(map(len, units), dtype=np.int64, count=len(texts))
    if config.shingle == "word":
        unit_hashes = _word_hashes(list(itertools.chain.from_iterable(units)))
    else:
        unit_hashes = _char_hashes("".join(units))
    counts = np.where(unit_counts >= config.ngram, unit_counts - config.ngram + 1, (unit_counts > 0).astype(np.int64))
    return _windows(unit_hashes, unit_counts, config.ngram), counts


def shingle_hash32(shingle: bytes, *, shingle_unit: Literal["word", "char"] = "word") -> int:
    """The `xxh3` shingle hash of one shingle's bytes (words joined by spaces, or the characters):
    a reference for tests, and a `hashfunc` for `datasketch.MinHash` that reproduces our signatures."""
    text = shingle.decode("utf-8", "surrogatepass")
    units = text.split(" ") if shingle_unit == "word" else text
    hashes = _word_hashes(units) if shingle_unit == "word" else _char_hashes(units)
    value = _windows(hashes, np.array([len(hashes)]), len(hashes))
    return int(value[0] >> _U64(32))


def shingles(text: str, config: MinHashConfig) -> list[bytes]:
    """The shingles of a document as bytes (what `hash: sha1` hashes, and what datasketch sees)."""
    units = _units(text, config)
    n = min(config.ngram, len(units))
    if n == 0:
        return []
    if config.shingle == "word":
        return [" ".join(units[i : i + n]).encode() for i in range(len(units) - n + 1)]
    return [units[i : i + n].encode("utf-8", "surrogatepass") for i in range(len(units) - n + 1)]


# ------------------------------------------------------------------------------------- signatures


def affine32_permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b), uint32: datasketch 2's `affine32` permutations `h -> a * h + b mod 2**32`, drawn from
    `np.random.RandomState(seed)` as `datasketch.MinHash(num_perm, seed)` draws them (an odd `a`: a bijection).
    Drawn here rather than read from a `MinHash`: importing datasketch imports scipy, which a worker need not."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return a, gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)


class MinHasher:
    """Computes MinHash signatures for many documents at once with datasketch's permutations."""

    def __init__(self, config: MinHashConfig) -> None:
        self.config = config
        self.a, self.b = affine32_permutations(config.num_perm, config.seed)

    def signatures(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """(signatures of shape (n, num_perm) uint32, mask of documents that have shingles)."""
        sig, has, _ = self.signatures_and_shingles(texts)
        return sig, has

    def signatures_and_shingles(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Signatures, the mask of documents with shingles, and (the 64-bit shingle hashes of all
        documents concatenated, each document's count) as `shingle_hashes64` gives them. A signature
        value is the minimum over a document's shingles of `a * fmix(h, 32) + b mod 2**32`, h the 32 bits
        of its hash datasketch would see: the low ones for sha1 (`sha1_hash32`: the first 4 digest bytes),
        the top ones for xxh3 (= `shingle_hash32`) and vector (`minhash_kernels.permuted_minimum`)."""
        hashes64, counts = shingle_hashes64(texts, self.config)
        sig = _kernels().permuted_minimum(np.ascontiguousarray(hashes64, dtype=_U64), np.asarray(counts, dtype=np.int64),
                                          self.a, self.b, self.config.hash != "sha1")
        return sig, counts > 0, (hashes64, counts)


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64 bucket keys: each band's rows combined into one 64-bit hash."""
    out = np.empty((sig.shape[0], bands), dtype=_U64)
    with np.errstate(over="ignore"):
        for k in range(bands):
            acc = np.full(sig.shape[0], _U64(k + 1), dtype=_U64)
            for j in range(k * rows, (k + 1) * rows):
                acc = acc * _POLY + sig[:, j].astype(_U64)
            out[:, k] = fmix(acc, 64)
    return out


def partition_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """A stable hash partition of int64/uint64 values."""
    with np.errstate(over="ignore"):
        return (fmix(values.astype(_U64), 64) % _U64(partitions)).astype(np.uint32)


SIGNATURE_BITS = 16
"""Each signature value is stored as its low 16 bits (b-bit MinHash, Li and Koenig 2010): two different
values agree by chance with probability 2**-16, which moves an estimate by at most (1 - J) / 65,536,
far inside its standard error (0.035 at J = 0.8 with 128 permutations), and halves the bytes."""


def stored_signatures(sig: np.ndarray) -> pa.FixedSizeBinaryArray:
    """Signatures (n, num_perm) as the `signature` column: the low `SIGNATURE_BITS` bits of each value."""
    low = np.ascontiguousarray(sig.astype(np.uint16))  # keeps the low 16 bits
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(2 * sig.shape[1]), len(low), [None, pa.py_buffer(low)])


def signature_values(column: pa.Array | pa.ChunkedArray, num_perm: int) -> np.ndarray:
    """The `signature` column back as an (n, num_perm) uint16 array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], pa.binary(2 * num_perm))
    values = np.frombuffer(column.buffers()[1], dtype=np.uint16) if len(column) else np.empty(0, np.uint16)
    return values[column.offset * num_perm : (column.offset + len(column)) * num_perm].reshape(-1, num_perm)


class MinHashStage:
    """The map side of near-dedup: bucket keys and (when verifying) signatures for a batch."""

    name = "minhash"

    def __init__(self, config: MinHashConfig) -> None:
        if config.partitions == "auto":  # the run sizes it from the input; used on its own, the floor
            config = dataclasses.replace(config, partitions=MIN_PARTITIONS)
        self.config = config
        self.bands, self.rows = config.lsh_params()
        self.hasher = MinHasher(config)

    @property
    def partitions(self) -> int:
        return self.config.partitions

    def keys(self, batch: pa.RecordBatch) -> dict[str, pa.Table]:
        """Two kinds of rows, each with its `partition`:

        - `buckets`: one row per (document, band): the band's bucket key (the band number is mixed
          into the key) and the document's order, partitioned by the key: 16 bytes a row;
        - `nodes`: one row per document, partitioned by its order: order, id (what a cluster's members
          are named by), its length (for `keep: longest`) and, when verifying, the signature
          (`SIGNATURE_BITS` a value) — stored once, not once per band — and, where the batch carries
          them, `text_at` and `text_bytes`: where the document's text lies in its read block.

        Shingle sets are not stored: the few pairs near the threshold are checked exactly against
        shingles recomputed from the two documents' text (`shingle_sets`), read by those ranges."""
        sig, has = self.hasher.signatures(batch.column("text"))
        order = batch.column("order").to_numpy()
        nodes = {"partition": partition_of(order, self.config.partitions), "order": order, "id": batch.column("id")}
        if self.config.keep == "longest":
            nodes["length"] = pc.utf8_length(batch.column("text")).cast(pa.int64())
        if self.config.verify:
            nodes["signature"] = stored_signatures(sig)
            for name in ("text_at", "text_bytes"):
                if name in batch.schema.names:
                    nodes[name] = batch.column(name)
        keys = band_keys(sig[has], self.bands, self.rows).reshape(-1)
        buckets = {
            "partition": partition_of(keys, self.config.partitions),
            "bucket": keys,
            "order": np.repeat(order[has], self.bands),
        }
        return {"buckets": pa.table(buckets), "nodes": pa.table(nodes)}


def shingle_sets(texts: pa.Array | list[str], config: MinHashConfig) -> list[np.ndarray]:
    """Each text's set of 64-bit shingle hashes (sorted, distinct): what the exact Jaccard compares."""
    hashes64, counts = shingle_hashes64(texts, config)
    return [distinct_sorted(part) for part in np.split(hashes64, np.cumsum(counts)[:-1])] if len(counts) else []


# ------------------------------------------------------------------------------------- verification


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (a sort and a mask: several times faster than `np.unique`'s
    hashing for uint64)."""
    s = np.sort(values)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def pair_jaccards(sets: list[np.ndarray], left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The Jaccard similarity of sets[left[i]] and sets[right[i]] for each i (sets as sorted arrays of distinct
    values; two empty sets are equal: 1.0)."""
    sizes = np.fromiter(map(len, sets), dtype=np.int64, count=len(sets))
    values = np.concatenate(sets).astype(_U64, copy=False) if sets else np.empty(0, _U64)
    left, right = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
    common = _kernels().sorted_intersections(values, np.r_[0, np.cumsum(sizes)], left, right)
    union = sizes[left] + sizes[right] - common
    return np.where(union > 0, common / np.maximum(union, 1), 1.0)


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets given as sorted arrays of distinct values."""
    return float(pair_jaccards([a, b], np.array([0]), np.array([1]))[0])


def _bucket_groups(buckets: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(orders sorted by bucket then order, group number of each): members of one bucket are consecutive."""
    bucket = buckets.column("bucket").to_numpy()
    order = buckets.column("order").to_numpy()
    rows = np.lexsort((order, bucket))
    bucket, order = bucket[rows], order[rows]
    same = bucket[1:] == bucket[:-1]
    return order, np.cumsum(np.r_[True, ~same])


def bucket_pairs(buckets: pa.Table, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate pairs of some buckets (every member of each present): within every bucket,
    each member (in input order) with each of the up to `window` members before it. A pair that
    shares several buckets is given once. Returns (earlier orders, later orders), sorted."""
    empty = np.empty(0, np.int64), np.empty(0, np.int64)
    if buckets.num_rows == 0:
        return empty
    order, group = _bucket_groups(buckets)
    earlier, later = [], []
    for k in range(1, window + 1):
        hit = group[k:] == group[:-k]
        if not hit.any():
            break
        earlier.append(order[:-k][hit])
        later.append(order[k:][hit])
    if not earlier:
        return empty
    return _unique_edges(np.concatenate(earlier), np.concatenate(later))


def star_edges(buckets: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Without verification: a star from each bucket's first document (input order) to every other
    member, the same components as all pairs. (smaller, larger) orders, distinct."""
    if buckets.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order, group = _bucket_groups(buckets)
    new_group = np.r_[True, group[1:] != group[:-1]]
    head = np.maximum.accumulate(np.where(new_group, np.arange(len(order)), 0))
    return _unique_edges(order[head[~new_group]], order[~new_group])


@dataclass(frozen=True)
class Candidates:
    """What the signatures decide about candidate pairs: the edges (pairs that reach the threshold)
    and the pairs too close to it to tell, left to `exact_edges`. Pairs are (earlier, later) orders."""

    edge_u: np.ndarray
    edge_v: np.ndarray
    near_u: np.ndarray
    near_v: np.ndarray
    pairs: int  # candidate pairs examined


def estimate_masks(sig_u: np.ndarray, sig_v: np.ndarray, config: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """(edge, near) masks of candidate pairs by their estimated Jaccard (the fraction of equal stored
    signature values): an edge at or above the threshold; with `exact_margin` > 0 an edge only from
    threshold + margin, no edge below threshold - margin, and the pairs in between `near`: too close
    to tell, left to `exact_edges`."""
    equal = np.empty(len(sig_u), dtype=np.int64)
    step = 1 << 14  # pairs per vectorised comparison: bounds the temporary to a few MB
    for s in range(0, len(sig_u), step):
        equal[s : s + step] = np.count_nonzero(sig_u[s : s + step] == sig_v[s : s + step], axis=1)
    estimate = equal / config.num_perm
    t, margin = config.threshold, config.exact_margin if config.exact else 0.0
    edge = estimate >= t + margin
    return edge, (estimate >= t - margin) & ~edge


def decide_pairs(u: np.ndarray, v: np.ndarray, sig_u: np.ndarray, sig_v: np.ndarray, config: MinHashConfig) -> Candidates:
    """`estimate_masks` applied to the pairs (u[i], v[i])."""
    edge, near = estimate_masks(sig_u, sig_v, config)
    return Candidates(u[edge], v[edge], u[near], v[near], len(u))


ShingleSets = Callable[[np.ndarray], dict[int, np.ndarray]]
"""Given document orders, their shingle sets (sorted distinct 64-bit hashes) by order."""


def exact_edges(u: np.ndarray, v: np.ndarray, shingle_sets: ShingleSets, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (u[i], v[i]) whose exact Jaccard of shingle sets reaches `threshold`; each
    document's set is fetched once."""
    if len(u) == 0:
        return u, v
    docs = np.unique(np.concatenate([u, v]))
    sets = shingle_sets(docs)
    keep = pair_jaccards([sets[d] for d in docs.tolist()], np.searchsorted(docs, u), np.searchsorted(docs, v)) >= threshold
    return u[keep], v[keep]


# ------------------------------------------------------------------------------------- clustering


def unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs (a[i], b[i]), sorted by a then b: `np.unique(np.stack([a, b], axis=1), axis=0)`'s
    rows, by a sort of the two keys (unique compares whole rows as bytes, several times slower)."""
    rows = np.lexsort((b, a))
    a, b = a[rows], b[rows]
    keep = np.empty(len(a), dtype=bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    keep[1:] |= b[1:] != b[:-1]
    return a[keep], b[keep]


def _unique_edges(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical undirected edges (smaller, larger), without self loops or repeats."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    keep = lo != hi
    if not keep.any():
        return np.empty(0, np.int64), np.empty(0, np.int64)
    lo, hi = unique_pairs(lo[keep], hi[keep])
    return lo.astype(np.int64), hi.astype(np.int64)


def _groups(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort directed edges by source; return (src, dst, index of each edge's group start)."""
    idx = np.lexsort((dst, src))
    src, dst = src[idx], dst[idx]
    starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
    return src, dst, starts


def large_star(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One large-star step over the directed edges of some source nodes (both directions of every
    undirected edge are present for each source): link every larger neighbour of u to the smallest
    node of u's closed neighbourhood. Returns undirected edges."""
    if len(src) == 0:
        return src, dst
    src, dst, starts = _groups(src, dst)
    group_min = np.minimum.reduceat(dst, starts)
    m = np.minimum(np.repeat(group_min, np.diff(np.r_[starts, len(src)])), src)
    larger = dst > src
    return _unique_edges(dst[larger], m[larger])


def small_star(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One small-star step: link u and every smaller neighbour of u to the smallest of them
    (all neighbours of a source are present, as in `large_star`). Returns undirected edges."""
    if len(src) == 0:
        return src, dst
    src, dst, _ = _groups(src, dst)
    smaller = dst <= src
    s_src, s_dst = src[smaller], dst[smaller]
    if len(s_src) == 0:  # no node has a smaller neighbour: nothing to link
        return np.empty(0, np.int64), np.empty(0, np.int64)
    starts = np.flatnonzero(np.r_[True, s_src[1:] != s_src[:-1]])
    group_min = np.minimum.reduceat(s_dst, starts)
    m = np.repeat(np.minimum(group_min, s_src[starts]), np.diff(np.r_[starts, len(s_src)]))
    # edges (v, m) for the smaller neighbours v, and (u, m) for u itself; u's edges to larger
    # neighbours are emitted by those neighbours, for which u is a smaller one
    a = np.concatenate([s_dst, s_src[starts]])
    b = np.concatenate([m, group_min])
    return _unique_edges(a, b)


def connected_components(a: np.ndarray, b: np.ndarray, max_rounds: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Large-star and small-star steps over all undirected edges (a, b) at once, until a large-star
    step's input equals the previous one's: (the converged edges, each node to the smallest node of
    its component; the number of steps). The distributed rounds reach the same edges."""
    previous = None
    for r in range(max_rounds):
        src, dst = np.concatenate([a, b]), np.concatenate([b, a])
        if r % 2 == 0:
            current = np.stack(_unique_edges(a, b), axis=1)
            if previous is not None and np.array_equal(previous, current):
                return a, b, r + 1
            previous = current
        a, b = (large_star if r % 2 == 0 else small_star)(src, dst)
    raise RuntimeError(f"near-dedup connected components did not converge in {max_rounds} rounds (dedup.minhash.max_rounds)")


def labels(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """After convergence: (node, smallest node of its component) for every source node."""
    if len(src) == 0:
        return src, dst
    src, dst, starts = _groups(src, dst)
    nodes = src[starts]
    return nodes, np.minimum(np.minimum.reduceat(dst, starts), nodes)


CLUSTER_SCHEMA = pa.schema([("id", pa.string()), ("cluster_id", pa.string()), ("kept", pa.bool_()), ("order", pa.int64())])


def choose_kept(members: pa.Table, keep: Literal["first", "longest"]) -> tuple[pa.Table, pa.Table]:
    """Given cluster members (columns order, label, id, length), keep one per cluster.
    Returns (losers, clusters): losers carry reason `near_duplicate` and the kept id; clusters list
    every member with its cluster id (the id of the cluster's first document) and a kept flag."""
    if members.num_rows == 0:
        return LOSER_SCHEMA.empty_table(), CLUSTER_SCHEMA.empty_table()
    if keep == "first":
        members = members.sort_by([("label", "ascending"), ("order", "ascending")])
    else:
        members = members.append_column("neg_length", pc.negate(members.column("length")))
        members = members.sort_by([("label", "ascending"), ("neg_length", "ascending"), ("order", "ascending")])
    label = members.column("label").to_numpy()
    order = members.column("order").to_numpy()
    ids = members.column("id")
    head = np.flatnonzero(np.r_[True, label[1:] != label[:-1]])
    sizes = np.diff(np.r_[head, len(label)])
    winner_row = np.repeat(head, sizes)
    first_row_by_order = np.repeat(
        head + np.array([np.argmin(order[h : h + s]) for h, s in zip(head, sizes)], dtype=np.int64), sizes
    )
    kept_mask = np.zeros(len(label), dtype=bool)
    kept_mask[head] = True
    losers = pa.table(
        {
            "order": pa.array(order[~kept_mask], pa.int64()),
            "reason": pa.array(["near_duplicate"] * int((~kept_mask).sum()), pa.string()),
            "kept_id": ids.take(pa.array(winner_row[~kept_mask])),
        },
        schema=LOSER_SCHEMA,
    )
    clusters = pa.table(
        {
            "id": ids,
            "cluster_id": ids.take(pa.array(first_row_by_order)),
            "kept": pa.array(kept_mask),
            "order": pa.array(order, pa.int64()),
        },
        schema=CLUSTER_SCHEMA,
    )
    return losers, clusters
