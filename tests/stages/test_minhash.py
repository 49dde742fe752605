"""MinHash-LSH pure parts: signatures equal datasketch's, the vectorised `hash: vector` equals a slow
reference and sees the words `str.split()` sees, banding reaches the candidate recall at the
threshold, every pair of a bucket is verified (by estimate, or by exact Jaccard near the threshold),
connected components equal a union-find, the keep rules."""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest
from datasketch import MinHash

from helpers import ASSETS
from datapipe.core.config import ConfigError, from_dict
from datapipe.testing.synthetic import EDITS, components, plant, true_pairs
from stages.minhash import (
    MinHashConfig,
    MinHasher,
    MinHashStage,
    affine32_permutations,
    bucket_pairs,
    candidate_probability,
    choose_kept,
    connected_components,
    decide_pairs,
    distinct_sorted,
    exact_edges,
    exact_jaccard,
    labels,
    large_star,
    partition_of,
    recall_banding,
    shingle_hash32,
    shingle_hashes64,
    shingle_sets,
    shingles,
    signature_values,
    small_star,
    star_edges,
    unique_pairs,
    vector_word_hash,
)
from stages import minhash

DOCS = [orjson.loads(line)["text"] for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]
MULTILINGUAL = [orjson.loads(line)["text"] for line in (ASSETS / "multilingual_sample.jsonl").read_bytes().splitlines()]
# Unicode corners of lowercasing and splitting: Python's special cases (İ, a word-final Σ), every kind
# of whitespace str.split() knows (NBSP, ideographic space, U+001C, NEL, ...), characters whose UTF-8
# holds the bytes of those (U+00C2, U+0130 inside words), a NUL inside a word, CJK, emoji
UNICODE_TEXTS = [
    "ΟΔΟΣ ΣΑΣ ΣΟΦΟΣ. Σ ΑΣ",
    "İstanbul İSTANBUL Iİ",
    "a\u00a0b\u3000c\x1cd\x1de\x85f\u2028g\u2029h\u202fi\u205fj\u1680k\u2000l\u200am\tn\x0bo\x0cp\rq",
    "Â\u00c2 \u0100\u0101 ÀÉÎ straße STRASSE",
    "a\x00b a b \u200bzero\u200bwidth",
    "日本語のテキスト 中文 文本 😀 😀 😀",
    "  leading and trailing whitespace only around the words  \n\n",
]

_M64 = (1 << 64) - 1


def _fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _M64
    return h ^ (h >> 33)


def _reference_word_hash(word: str) -> int:
    """The documented `hash: vector` word hash, by Horner's rule over the UTF-8 bytes in reverse."""
    data = word.encode()
    value = 0
    for byte in reversed(data):
        value = (value * 0xC2B2AE3D27D4EB4F + byte) & _M64
    return _fmix64((value + len(data) * 0x165667B19E3779F9) & _M64)


def _combine(word_hashes: list[int]) -> int:
    value = 0
    for h in word_hashes:
        value = (value * 0x9E3779B97F4A7C15 + h) & _M64
    return value


def _reference_shingle_hashes(text: str, ngram: int, lowercase: bool = True, words: str = "whitespace") -> list[int]:
    r"""64-bit shingle hashes as `hash: vector` documents them: the words of `text.lower().split()` (or of
    `re.findall(r"\w+", text.lower())` with words: alnum), each window of n (or all words, when fewer)
    combined as h = h * 0x9E3779B97F4A7C15 + word hash."""
    text = text.lower() if lowercase else text
    words = [_reference_word_hash(w) for w in (re.findall(r"\w+", text) if words == "alnum" else text.split())]
    n = min(ngram, len(words))
    return [_combine(words[i : i + n]) for i in range(len(words) - n + 1)] if n else []


def _reference_hash32(shingle: bytes) -> int:
    """A `hashfunc` for datasketch: the top 32 bits of one shingle's (its words joined by spaces) hash."""
    return _combine([_reference_word_hash(w) for w in shingle.decode().split(" ")]) >> 32


@pytest.mark.parametrize("unit", ["word", "char"])
@pytest.mark.parametrize("hash_name", ["sha1", "xxh3", "vector"])
def test_signatures_equal_datasketch(unit, hash_name):
    cfg = MinHashConfig(shingle=unit, hash=hash_name, ngram=5 if unit == "word" else 9, num_perm=64, seed=7)
    sig, has = MinHasher(cfg).signatures(DOCS[:12] + ["one two"])  # the last one is shorter than a shingle
    assert has.all()
    for text, row in zip(DOCS[:12] + ["one two"], sig):
        kwargs = {} if hash_name == "sha1" else {"hashfunc": lambda b: shingle_hash32(b, shingle_unit=unit)}
        if hash_name == "vector" and unit == "word":  # (for characters, vector is xxh3)
            kwargs = {"hashfunc": _reference_hash32}
        ref = MinHash(num_perm=64, seed=7, **kwargs)
        ref.update_batch(shingles(text, cfg))
        assert np.array_equal(ref.hashvalues, row)


def test_permutations_are_datasketchs():
    for num_perm, seed in [(128, 1), (64, 7), (1, 123), (256, 2**31)]:
        a, b = affine32_permutations(num_perm, seed)
        ref_a, ref_b = MinHash(num_perm=num_perm, seed=seed).permutations
        assert a.dtype == b.dtype == np.uint32 and a.tolist() == ref_a.tolist() and b.tolist() == ref_b.tolist()


@pytest.mark.parametrize("words", ["alnum", "whitespace"])
def test_vector_hash_equals_a_slow_reference(words):
    texts = ["", "   ", "one", "one two", "a b c d", *UNICODE_TEXTS, *DOCS[:6], *MULTILINGUAL[:6], "x" * 70_000 + " y",
             "end. end, (end) end! -- «end» end…end_of_line 3.14 a-b"]
    cfg = MinHashConfig(hash="vector", num_perm=64, seed=3, words=words)
    flat, counts = shingle_hashes64(texts, cfg)
    expected = [_reference_shingle_hashes(t, cfg.ngram, words=words) for t in texts]
    assert counts.tolist() == [len(e) for e in expected]
    assert flat.tolist() == [h for e in expected for h in e]
    assert all(vector_word_hash(w.encode()) == _reference_word_hash(w) for t in UNICODE_TEXTS for w in t.lower().split())
    # the signatures: datasketch's MinHash over the same shingles, hashed by the reference's top 32 bits
    sig, has = MinHasher(cfg).signatures(texts)
    assert has.tolist() == [bool(e) for e in expected]
    for text, row in zip(texts, sig):
        ref = MinHash(num_perm=64, seed=3, hashfunc=_reference_hash32)
        ref.update_batch(shingles(text, cfg))
        assert np.array_equal(ref.hashvalues, row)
    # without lowercasing
    raw, _ = shingle_hashes64(texts, MinHashConfig(hash="vector", lowercase=False, words=words))
    assert raw.tolist() == [h for t in texts for h in _reference_shingle_hashes(t, 5, lowercase=False, words=words)]


def test_alnum_words_ignore_punctuation():
    # the default rule: a change of punctuation is no change of words (whitespace: three of five words differ)
    a, b = "The end. It works, really!", "the end it works really"
    for hash_name in ("vector", "xxh3", "sha1"):
        alnum = MinHashConfig(hash=hash_name)
        assert alnum.words == "alnum" and shingle_sets([a], alnum)[0].tolist() == shingle_sets([b], alnum)[0].tolist()
        spaces = MinHashConfig(hash=hash_name, words="whitespace")
        assert shingle_sets([a], spaces)[0].tolist() != shingle_sets([b], spaces)[0].tolist()


_WITHOUT_A_CACHE_FOLDER = """
import json, warnings
from numba.core import caching
caching.CacheImpl._locator_classes = []  # as if no folder numba could cache in were writable
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from stages import minhash_kernels  # noqa: F401 - its loops, compiled without a cache
from datapipe.core import compiled
from stages.minhash import MinHashConfig, shingle_hashes64
flat, counts = shingle_hashes64(["One two, three four five six.", "", "x"], MinHashConfig())
print(json.dumps([compiled.CACHE, [str(w.message) for w in caught], flat.tolist(), counts.tolist()]))
"""


def test_the_loops_compile_where_nothing_can_cache_them():
    # a read-only installation without a writable home: a warning that names the fix, and the same hashes
    done = subprocess.run([sys.executable, "-c", _WITHOUT_A_CACHE_FOLDER], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cached, warned, flat, counts = orjson.loads(done.stdout.strip().splitlines()[-1])
    assert cached is False and any("NUMBA_CACHE_DIR" in w for w in warned), warned
    expected, expected_counts = shingle_hashes64(["One two, three four five six.", "", "x"], MinHashConfig())
    assert flat == expected.tolist() and counts == expected_counts.tolist() == [2, 0, 1]


_COMPILED_WITHOUT_SCIPY_LINALG = """
import json, sys
from stages.minhash import MinHashConfig, shingle_hashes64
flat, counts = shingle_hashes64(["One two, three four five six."], MinHashConfig())
loaded_by_the_loops = "scipy.linalg" in sys.modules
import numba.np.arraymath, scipy.linalg
print(json.dumps([loaded_by_the_loops, numba.np.arraymath._HAVE_BLAS, float(scipy.linalg.norm([3.0, 4.0])), counts.tolist()]))
"""


def test_the_loops_run_without_loading_scipy_linalg_which_still_imports_afterwards():
    # numba's BLAS check would import scipy.linalg in every worker that runs a loop; no loop uses BLAS
    done = subprocess.run([sys.executable, "-c", _COMPILED_WITHOUT_SCIPY_LINALG], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert orjson.loads(done.stdout.strip().splitlines()[-1]) == [False, False, 5.0, [2]]


def test_vector_hash_is_pinned():
    # the same text gives the same signature on any machine: a change of formula fails here
    assert vector_word_hash(b"hello") == _reference_word_hash("hello") == 0xF94B193FEE7FFC72
    sig, _ = MinHasher(MinHashConfig(hash="vector", words="whitespace")).signatures(DOCS[:3])
    assert hashlib.sha256(sig.tobytes()).hexdigest()[:16] == "32463c763daf6576"


def _words_that_differ(texts: list[str]) -> list[int]:
    """Indices of the texts whose `hash: vector` words are not those of `text.lower().split()`."""
    hashes, counts = minhash._vector_units(pa.array(texts, pa.large_string()), lowercase=True)
    python_words = [t.lower().split() for t in texts]
    # Python's words, joined by spaces and hashed without lowering: a word holding a character the
    # vector path splits on, or lowers differently, gives a different count or hash
    expected, expected_counts = minhash._vector_units(pa.array([" ".join(ws) for ws in python_words], pa.large_string()), False)
    python_counts = np.array([len(ws) for ws in python_words])
    same = (counts == python_counts) & (expected_counts == python_counts)
    unequal = hashes[np.repeat(same, counts)] != expected[np.repeat(same, expected_counts)]
    return sorted(set(np.flatnonzero(~same).tolist()) | set(np.repeat(np.arange(len(texts)), counts)[np.repeat(same, counts)][unequal].tolist()))


def test_vector_words_are_those_of_str_split_for_every_code_point():
    # Every code point inside a word, between two words and alone gives the words of
    # `text.lower().split()` (Arrow lowers, Python's special cases İ and Σ go to Python), except
    # letters newer than Python's Unicode database, which Python leaves as they are.
    code_points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    groups = [code_points[i : i + 64] for i in range(0, len(code_points), 64)]
    texts = [" ".join(f"Ab{chr(c)}Cd {chr(c)} x{chr(c)}" for c in group) for group in groups]
    suspects = [c for g in _words_that_differ(texts) for c in groups[g]]
    singles = [f"Ab{chr(c)}Cd {chr(c)} x{chr(c)}" for c in suspects]
    differ = [suspects[i] for i in _words_that_differ(singles)]
    assert all(unicodedata.category(chr(c)) == "Cn" for c in differ), [hex(c) for c in differ]
    assert _words_that_differ(UNICODE_TEXTS + MULTILINGUAL + DOCS) == []
    # the table of whitespace is complete: nothing above U+FFFF is whitespace
    assert not any(chr(c).isspace() for c in range(0x10000, 0x110000))


def test_vector_alnum_words_are_those_of_python_regex_for_every_code_point():
    # every code point inside a word, between two words and alone: the words of re.findall(r"\w+", text.lower())
    # (but letters newer than Python's Unicode database, "Cn" to Python, which Arrow lowers and Python does not)
    code_points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and unicodedata.category(chr(c)) != "Cn"]
    texts = [" ".join(f"Ab{chr(c)}Cd {chr(c)} x{chr(c)}" for c in code_points[i : i + 256]) for i in range(0, len(code_points), 256)]
    hashes, counts = minhash._vector_units(pa.array(texts, pa.large_string()), True, "alnum")
    words = [re.findall(r"\w+", t.lower()) for t in texts]
    assert counts.tolist() == [len(w) for w in words]
    # Python's words joined by spaces, hashed without lowering or classifying (the whitespace rule, itself
    # checked against a pure-Python reference above): the same hashes, word for word
    expected, expected_counts = minhash._vector_units(pa.array([" ".join(w) for w in words], pa.large_string()), False)
    assert expected_counts.tolist() == counts.tolist() and np.array_equal(expected, hashes)


def test_batch_signatures_equal_each_document_alone():
    # documents shorter than a shingle, empty ones and long ones interleaved: the batch's windows
    # never cross a document boundary
    texts = ["", DOCS[0], "one two", DOCS[1], "  ", "x", DOCS[2], "a b c d", DOCS[3]]
    for unit, n in [("word", 5), ("char", 9)]:
        cfg = MinHashConfig(shingle=unit, ngram=n, num_perm=32)
        hasher = MinHasher(cfg)
        sig, has = hasher.signatures(texts)
        for text, row, h in zip(texts, sig, has):
            alone, alone_has = hasher.signatures([text])
            assert h == alone_has[0] and np.array_equal(row, alone[0])
        flat, counts = shingle_hashes64(texts, cfg)
        assert counts.tolist() == [len(shingles(t, cfg)) for t in texts]
        assert len(flat) == counts.sum()


def test_banding_reaches_the_candidate_recall_at_the_threshold():
    assert MinHashConfig().lsh_params() == (16, 6)  # 128 permutations, threshold 0.8, recall 0.99
    for t, n, recall in [(0.8, 128, 0.99), (0.8, 128, 0.999), (0.5, 128, 0.99), (0.9, 256, 0.95), (0.7, 64, 0.99)]:
        b, r = recall_banding(t, n, recall)
        assert b * r <= n and candidate_probability(t, b, r) >= recall
        # the steepest banding that can: more rows per band cannot reach it with num_perm permutations ...
        assert all(candidate_probability(t, n // more, more) < recall for more in range(r + 1, n + 1))
        # ... and the fewest bands that do
        assert b == 1 or candidate_probability(t, b - 1, r) < recall
    # datasketch's balanced choice (the previous default) makes a pair at the threshold a candidate < half the time
    assert candidate_probability(0.8, 9, 13) < 0.45
    assert MinHashConfig(bands=16, rows=8).lsh_params() == (16, 8)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="dedup.minhash.bands and rows must be given together"):
        from_dict(MinHashConfig, {"bands": 4}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"bands x rows must be <= num_perm \(64\), got 9 x 13"):
        from_dict(MinHashConfig, {"num_perm": 64, "bands": 9, "rows": 13}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"threshold must be in \(0, 1\), got 1.5"):
        from_dict(MinHashConfig, {"threshold": 1.5}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"dedup.minhash.candidate_recall must be in \(0, 1\), got 1"):
        from_dict(MinHashConfig, {"candidate_recall": 1}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"dedup.minhash.exact_margin must be in \[0, 1\], got -0.1"):
        from_dict(MinHashConfig, {"exact_margin": -0.1}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"dedup.minhash.bucket_window must be >= 1, got 0"):
        from_dict(MinHashConfig, {"bucket_window": 0}, key="dedup.minhash")


def _distributed_components(edges, partitions):
    """Large-star / small-star rounds as the runner runs them: each partition sees only the
    directed edges of its own source nodes."""
    a = np.array([e[0] for e in edges], dtype=np.int64)
    b = np.array([e[1] for e in edges], dtype=np.int64)
    previous, r = None, 0
    while True:
        src, dst = np.concatenate([a, b]), np.concatenate([b, a])
        part = partition_of(src, partitions)
        pairs = np.unique(np.stack([src, dst], 1), axis=0)
        if r % 2 == 0:
            if previous is not None and np.array_equal(previous, pairs):
                break
            previous = pairs
        step = large_star if r % 2 == 0 else small_star
        outs = [step(src[part == p], dst[part == p]) for p in range(partitions)]
        a = np.concatenate([o[0] for o in outs])
        b = np.concatenate([o[1] for o in outs])
        r += 1
    nodes, label = labels(np.concatenate([a, b]), np.concatenate([b, a]))
    return dict(zip(nodes.tolist(), label.tolist())), r


def _in_one_task(edges):
    a, b, rounds = connected_components(np.array([e[0] for e in edges]), np.array([e[1] for e in edges]), 64)
    nodes, label = labels(np.concatenate([a, b]), np.concatenate([b, a]))
    return dict(zip(nodes.tolist(), label.tolist())), rounds


def test_connected_components_equal_union_find_on_random_graphs():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 80)
        edges = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 100))]
        edges = [(x, y) for x, y in edges if x != y]
        if not edges:
            continue
        got, rounds = _distributed_components(edges, partitions=rng.randint(1, 5))
        labels = components(n, edges)  # brute-force union-find over every document
        nodes = {x for e in edges for x in e}
        assert got == {x: labels[x] for x in nodes}
        assert rounds < 40
        in_memory, steps = _in_one_task(edges)  # the one-task path: the same labels
        assert in_memory == got and steps < 40


def test_unique_pairs_are_the_distinct_rows_in_order():
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 500):
        a, b = rng.integers(0, 6, n), rng.integers(-3, 3, n)  # many repeats, one key equal across rows
        expected = sorted(set(zip(a.tolist(), b.tolist())))
        x, y = unique_pairs(a, b)
        assert list(zip(x.tolist(), y.tolist())) == expected


def test_long_chain_converges():
    chain = [(i, i + 1) for i in range(500)]
    got, rounds = _distributed_components(chain, partitions=4)
    assert set(got.values()) == {0} and rounds < 40


def _batch(texts):
    from datapipe.core.schema import DOC_SCHEMA

    rows = [{"id": f"d{i}", "domain": "d", "text": t, "order": i} for i, t in enumerate(texts)]
    return pa.RecordBatch.from_pylist(rows, schema=DOC_SCHEMA)


def _decided(keys, config):
    """The map side's candidate pairs decided by their stored signatures, in memory."""
    u, v = bucket_pairs(keys["buckets"], config.bucket_window)
    nodes = keys["nodes"]
    sig = signature_values(nodes.column("signature"), config.num_perm)
    row = {o: i for i, o in enumerate(nodes.column("order").to_pylist())}
    return decide_pairs(u, v, sig[[row[o] for o in u.tolist()]], sig[[row[o] for o in v.tolist()]], config)


def test_candidates_are_verified_by_estimated_jaccard():
    base = max(DOCS, key=len)
    words = base.split()
    near = " ".join(words[:-3] + ["changed", "words", "here"])  # Jaccard of 5-grams ~0.99
    far = min(DOCS, key=len)
    stage = MinHashStage(MinHashConfig(partitions=1))
    keys = stage.keys(_batch([base, near, far, base]))
    found = _decided(keys, stage.config)
    assert list(zip(found.edge_u.tolist(), found.edge_v.tolist())) == [(0, 1), (0, 3), (1, 3)]
    assert len(found.near_u) == 0  # all far above the threshold: no exact check needed
    nodes = keys["nodes"]
    assert nodes.column("order").to_pylist() == [0, 1, 2, 3]
    # the id (the cluster members' names) and the signature once per document, 16 bits a value, and nothing else
    # (no length with keep: first); the buckets one row per band: no signature, no shingles
    assert nodes.column_names == ["partition", "order", "id", "signature"]
    assert nodes.column("signature").type == pa.binary(2 * stage.config.num_perm)
    assert MinHashStage(MinHashConfig(partitions=1, keep="longest")).keys(_batch([base]))["nodes"].column_names == [
        "partition", "order", "id", "length", "signature"]
    # where the batch says where each text lies in its read block, the nodes keep it for the exact check
    located = _batch([base]).append_column("text_at", pa.array([7], pa.int64())).append_column("text_bytes", pa.array([9], pa.int64()))
    assert stage.keys(located)["nodes"].select(["text_at", "text_bytes"]).to_pylist() == [{"text_at": 7, "text_bytes": 9}]
    assert keys["buckets"].column_names == ["partition", "bucket", "order"] and set(keys) == {"buckets", "nodes"}
    full, _ = stage.hasher.signatures([far])
    assert signature_values(nodes.column("signature"), stage.config.num_perm)[2].tolist() == (full[0] & 0xFFFF).tolist()


def _one_bucket(signatures):
    """A bucket partition holding one bucket whose members are documents 0, 1, ...; their signatures."""
    n = len(signatures)
    buckets = pa.table({"bucket": np.full(n, 42, np.uint64), "order": np.arange(n, dtype=np.int64)})
    return buckets, np.array(signatures, dtype=np.uint16)


def _decide_bucket(buckets, sig, config):
    u, v = bucket_pairs(buckets, config.bucket_window)
    return decide_pairs(u, v, sig[u], sig[v], config)


def _changed(base, k, salt):
    """`base` with its first k values replaced by values no other signature has."""
    out = base.copy()
    out[:k] = 10_000 * (salt + 1) + np.arange(k)
    return out


def test_every_pair_of_a_bucket_is_verified_not_only_pairs_with_its_first_member():
    # A shares the bucket with B and C but resembles neither; B and C are near-duplicates (est. 0.9)
    a, b = np.arange(100), np.arange(1000, 1100)
    buckets, sig = _one_bucket([a, b, _changed(b, 10, 2)])
    found = _decide_bucket(buckets, sig, MinHashConfig(num_perm=100, exact_margin=0.0))
    assert list(zip(found.edge_u.tolist(), found.edge_v.tolist())) == [(1, 2)]
    # without verification, a star from the bucket's first member: the same components as all pairs
    assert list(zip(*map(np.ndarray.tolist, star_edges(buckets)))) == [(0, 1), (0, 2)]


def test_bucket_window_bounds_the_pairs_of_a_big_bucket():
    buckets, _ = _one_bucket([np.arange(8)] * 5)
    u, v = bucket_pairs(buckets, 2)
    assert sorted(zip(u.tolist(), v.tolist())) == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4)]
    u, v = bucket_pairs(buckets, 4)  # window >= size - 1: every pair
    assert sorted(zip(u.tolist(), v.tolist())) == [(i, j) for i in range(5) for j in range(i + 1, 5)]
    # two buckets: pairs never cross them, and a pair sharing both is given once
    two = pa.table({"bucket": np.array([1, 1, 2, 2, 2], np.uint64), "order": np.array([0, 1, 0, 1, 2], np.int64)})
    u, v = bucket_pairs(two, 4)
    assert sorted(zip(u.tolist(), v.tolist())) == [(0, 1), (0, 2), (1, 2)]


def test_pairs_near_the_threshold_are_decided_by_exact_jaccard():
    base = np.arange(100)
    # estimated Jaccard with document 0: 0.75, 0.85 (both within 0.12 of 0.8), 0.95 and 0.6 (clear)
    sigs = [base, _changed(base, 25, 1), _changed(base, 15, 2), _changed(base, 5, 3), _changed(base, 40, 4)]
    buckets, sig = _one_bucket(sigs)
    found = _decide_bucket(buckets, sig, MinHashConfig(num_perm=100, exact_margin=0.12))
    edges = set(zip(found.edge_u.tolist(), found.edge_v.tolist()))
    near = set(zip(found.near_u.tolist(), found.near_v.tolist()))
    assert (0, 3) in edges and {(0, 1), (0, 2)} <= near and not {(0, 4)} & (edges | near)
    # exact Jaccard: document 1 truly is a near-duplicate (0.818), document 2 is not (0.786)
    sets = {0: np.arange(100), 1: np.r_[np.arange(90), 500 + np.arange(10)], 2: np.r_[np.arange(88), 600 + np.arange(12)]}
    sets = {k: distinct_sorted(v.astype(np.uint64)) for k, v in sets.items()}
    a, b = exact_edges(np.array([0, 0]), np.array([1, 2]), lambda orders: {o: sets[o] for o in orders.tolist()}, 0.8)
    assert list(zip(a.tolist(), b.tolist())) == [(0, 1)]
    # with no margin the estimate decides alone: 0.85 passes, 0.75 does not
    alone = _decide_bucket(buckets, sig, MinHashConfig(num_perm=100, exact_margin=0.0))
    assert {(0, 2), (0, 3)} <= set(zip(alone.edge_u.tolist(), alone.edge_v.tolist())) and len(alone.near_u) == 0


def test_exact_jaccard_equals_python_sets():
    rng = np.random.default_rng(0)
    for _ in range(300):
        x = rng.integers(0, 400, rng.integers(0, 200)).astype(np.uint64)
        y = rng.integers(0, 400, rng.integers(0, 200)).astype(np.uint64)
        sx, sy = set(x.tolist()), set(y.tolist())
        assert distinct_sorted(x).tolist() == sorted(sx)
        expected = len(sx & sy) / len(sx | sy) if sx | sy else 1.0
        assert exact_jaccard(distinct_sorted(x), distinct_sorted(y)) == pytest.approx(expected, abs=1e-12)


def test_keep_first_and_longest():
    members = pa.table({"order": [5, 2, 9, 7], "label": [2, 2, 2, 7], "id": ["e", "b", "i", "g"], "length": [10, 3, 30, 1]})
    losers, clusters = choose_kept(members, "first")
    assert sorted(zip(losers.column("order").to_pylist(), losers.column("kept_id").to_pylist())) == [(5, "b"), (9, "b")]
    losers, clusters = choose_kept(members, "longest")
    assert sorted(zip(losers.column("order").to_pylist(), losers.column("kept_id").to_pylist())) == [(2, "i"), (5, "i")]
    assert set(losers.column("reason").to_pylist()) == {"near_duplicate"}
    rows = {r["id"]: r for r in clusters.to_pylist()}
    assert rows["i"]["kept"] and rows["i"]["cluster_id"] == "b" and rows["g"]["cluster_id"] == "g"


def _near_duplicate_pairs(texts: list[str], config: MinHashConfig) -> set[tuple[int, int]]:
    """The pairs of documents one cluster holds after the map side, the candidate decisions and
    the exact checks, all in memory."""
    stage = MinHashStage(config)
    keys = stage.keys(_batch(texts))
    found = _decided(keys, config)
    sets = dict(enumerate(shingle_sets(texts, config)))
    u, v = exact_edges(found.near_u, found.near_v, lambda orders: {o: sets[o] for o in orders.tolist()}, config.threshold)
    edges = list(zip(np.r_[found.edge_u, u].tolist(), np.r_[found.edge_v, v].tolist()))
    labels_ = components(len(texts), edges)
    return {(a, b) for a in range(len(texts)) for b in range(a + 1, len(texts)) if labels_[a] == labels_[b]}


def test_vector_finds_the_near_duplicates_xxh3_finds():
    # the test corpus slice with planted copies of its documents (two each) at Jaccard 0.70-0.95
    rng = random.Random(5)
    cfg = MinHashConfig(partitions=1, hash="vector")
    texts = list(DOCS + MULTILINGUAL)
    for i, text in enumerate(DOCS + MULTILINGUAL[:20]):
        if len(text.split()) < 60:
            continue
        for level in (0.70 + 0.05 * (i % 6), 0.78 + 0.02 * (i % 5)):
            texts.append(plant(text, level, EDITS[(i + len(texts)) % 2 + 1], rng, cfg)[0])  # word swaps, headers
    truth_labels = components(len(texts), true_pairs(texts, cfg, cfg.threshold))
    truth = {(a, b) for a in range(len(texts)) for b in range(a + 1, len(texts)) if truth_labels[a] == truth_labels[b]}
    by_vector = _near_duplicate_pairs(texts, cfg)
    by_xxh3 = _near_duplicate_pairs(texts, MinHashConfig(partitions=1, hash="xxh3"))
    assert len(truth) >= 40, len(truth)
    assert len(by_vector ^ by_xxh3) <= 0.02 * len(truth)
    assert len(by_vector & truth) >= 0.98 * len(truth) and len(by_vector - truth) <= 0.02 * len(truth)
