"""Compile a byte-level BPE `tokenizer.json` into tiktoken's encoder, when (and only when) both give
the same ids on every input; and check that on a sample of real documents.

The `tokenizer.json` stays the source of truth: training, the vocabulary and the merges live in
`tokenizers`. tiktoken's Rust core encodes the same tokenizer several times faster (BENCHMARKS.md), but the
two BPE algorithms differ:

- `tokenizers` (`Word::merge_all`) starts from one symbol per byte and repeatedly merges the adjacent
  pair with the lowest *merge rank* (its index in `merges`; leftmost on ties). A pair that is not in
  `merges` never merges.
- tiktoken (`_byte_pair_merge`) merges the adjacent pair whose *concatenated bytes* have the lowest
  *token rank* (here: the token id; leftmost on ties), whichever two tokens it came from, and returns
  a whole pre-token at once when its bytes are a token.

So tiktoken may merge a "phantom" pair (x, y) whose bytes xy form a token made by another merge
(x', y'), and it orders merges by token id instead of merge rank. `compile_bpe` accepts a tokenizer
only under conditions that make the two coincide exactly (each one is checked; the first that fails
is the reason given for falling back to `tokenizers`):

- C0  the pipeline around the model is the same: BPE model without dropout, subword prefix/suffix,
      byte fallback or `ignore_merges`; no normalizer; the GPT-2 split (`ByteLevel` with
      `use_regex` and without `add_prefix_space`, or `Split` on exactly the GPT-2 pattern followed by
      `ByteLevel` without regex); no truncation or padding; a post-processor that adds nothing when
      called with `add_special_tokens=False` (none, `ByteLevel`, `TemplateProcessing`); every added
      token is special (with `encode_special_tokens` on, `tokenizers` then never matches them inside
      text, and tiktoken's `encode_ordinary` never does either).
- C1  every vocabulary entry (added tokens aside) decodes through the byte-level alphabet, and all
      256 single bytes are tokens (so neither side ever needs an unknown token).
- C2  the merges are consistent with the vocabulary: both parts and the concatenation are tokens,
      the result's id is greater than both parts', and the result ids strictly increase in merge
      order. Hence each multi-byte token has at most one merge, and token-id order = merge order.
- C3  every multi-byte token is reachable and self-consistent: `tokenizers`' BPE applied to the
      token's own bytes returns that single token.

Why C0-C3 suffice (per pre-token; the split is the same regex on both sides). Induction on the merge
steps, with both sides in the same state s_1 … s_k. Take adjacent (s_j, s_j+1) whose bytes u form a
token t. No merge so far crossed u's edges (tokens never split), so the merges inside u are exactly
the first steps `tokenizers` takes on u alone (each step takes the minimum over all pairs, hence over
the pairs inside u, in the same order). By C3 that run on u ends in [t], so from [s_j, s_j+1] its next
step merges that pair: (s_j, s_j+1) is t's merge. So no phantom pair is ever adjacent, the candidate
pairs are the same on both sides, and by C2 they are ordered the same way (token id <-> merge rank,
ties only between occurrences of the same merge, both leftmost-first). tiktoken's whole-piece
shortcut gives [t] for a piece with t's bytes, which is what C3 says `tokenizers` gives. (C2 also
keeps clear of a `tokenizers` quirk: it recognises stale queue entries by the merged id, which is
only sound when each id has one merge.) `tokenizers`' own BPE trainer produces vocabularies with all
of these properties: it appends one new token per merge, in merge order.

What the conditions cannot cover is the regex engines themselves: `tokenizers` runs the pattern
with Oniguruma, tiktoken with fancy-regex, each with its own Unicode tables (which code points are
letters, numbers, white space). Measured agreement over every code point is in BENCHMARKS.md
and in `tests/stages/test_fast_bpe.py`; and `first_mismatch` compares ids on a sample of
the actual input before a run relies on the fast path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np


# The pattern `tokenizers`' ByteLevel pre-tokenizer uses when `use_regex` is true (GPT-2's).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Post-processors that add no ids when called with add_special_tokens=False (TokenizeStage's call)
# and only touch offsets otherwise.
_ID_NEUTRAL_POST_PROCESSORS = {"ByteLevel", "TemplateProcessing"}


class NotEquivalent(ValueError):
    """The tokenizer cannot be compiled into an encoder that is provably identical; says why."""


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, as {char: byte} (the one `tokenizers` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class CompiledBPE:
    """What tiktoken needs: token bytes -> id (added tokens excluded) and the split pattern."""

    ranks: dict[bytes, int]
    pattern: str
    special_tokens: dict[str, int]  # the added tokens, never matched inside text

    def encoder(self) -> "FastEncoder":
        return FastEncoder(self)


class FastEncoder:
    """tiktoken's core over a compiled tokenizer, single-threaded: one per worker process, so N
    workers use N cores (tiktoken's `encode_ordinary_batch` would start its own thread pool).
    Batches of Arrow text go through `stages.fast_bpe_kernels.PieceEncoder` (the GPT-2 split compiled, each piece's
    ids remembered): the same ids as tiktoken's `encode_ordinary`, several times faster."""

    def __init__(self, compiled: CompiledBPE) -> None:
        import tiktoken

        from stages.fast_bpe_kernels import PieceEncoder

        self.compiled = compiled
        self._encoding = tiktoken.Encoding(
            "datapipe-compiled-bpe", pat_str=compiled.pattern, mergeable_ranks=compiled.ranks, special_tokens={}
        )
        # `encode_ordinary` matches no special token (there are none here, and the ordinary path
        # never looks for them), so literal "<|endoftext|>" is plain text. The Rust object's method
        # directly saves a Python call per document; the public method is the same code.
        core = getattr(self._encoding, "_core_bpe", None)
        self._encode = core.encode_ordinary if core is not None else self._encoding.encode_ordinary
        self._pieces = PieceEncoder(self._encoding)  # its split is GPT2_PATTERN, the one pattern compile_bpe accepts

    def encode(self, text: str) -> list[int]:
        try:
            return self._encode(text)
        except UnicodeEncodeError:  # lone surrogates: never in Arrow text (valid UTF-8); as tiktoken does
            return self._encoding.encode_ordinary(text)

    def encode_array(self, text: "pa.Array", head: int = -1, tail: int = -1) -> tuple[np.ndarray, np.ndarray]:
        """(every document's ids as one uint32 array, with `head` before and `tail` after each where >= 0; each
        document's count) for an Arrow string array."""
        return self._pieces.encode(text, head, tail)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        import pyarrow as pa

        try:
            column = pa.array(texts, pa.large_string())
        except (UnicodeEncodeError, pa.ArrowException):  # lone surrogates: tiktoken's own path, text by text
            return [self.encode(t) for t in texts]
        flat, lengths = self.encode_array(column)
        return [ids.tolist() for ids in np.split(flat, np.cumsum(lengths)[:-1])] if len(texts) else []


def _model_spec(tokenizer_json: str) -> dict[str, Any]:
    """The tokenizer as `tokenizers` itself serializes it (defaults filled, merges as pairs)."""
    from tokenizers import Tokenizer

    return json.loads(Tokenizer.from_str(tokenizer_json).to_str())


def _check_pipeline(spec: dict[str, Any]) -> None:
    """C0: the parts around the model behave the same as tiktoken's regex split + encode_ordinary."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise NotEquivalent(f"model type is {model.get('type')!r}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise NotEquivalent(f"BPE dropout is {model['dropout']!r} (random merges)")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise NotEquivalent(f"BPE {key} is {model[key]!r}")
    for key in ("byte_fallback", "ignore_merges"):
        if model.get(key):
            raise NotEquivalent(f"BPE {key} is true")
    if spec.get("normalizer") is not None:
        raise NotEquivalent(f"it has a normalizer ({spec['normalizer'].get('type')})")
    for key in ("truncation", "padding"):
        if spec.get(key) is not None:
            raise NotEquivalent(f"{key} is configured in the tokenizer.json")
    _check_pre_tokenizer(spec.get("pre_tokenizer"))
    post = spec.get("post_processor")
    posts = [] if post is None else post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for p in posts:
        if p.get("type") not in _ID_NEUTRAL_POST_PROCESSORS:
            raise NotEquivalent(f"post-processor {p.get('type')!r} is not known to leave ids alone")
    for tok in spec.get("added_tokens") or []:
        if not tok.get("special"):
            raise NotEquivalent(f"added token {tok['content']!r} is not special (tokenizers would match it inside text)")


def _is_byte_level(p: Any, *, use_regex: bool) -> bool:
    return (
        isinstance(p, dict)
        and p.get("type") == "ByteLevel"
        and p.get("add_prefix_space") is False
        and bool(p.get("use_regex", True)) is use_regex
    )


def _check_pre_tokenizer(pre: Any) -> None:
    if _is_byte_level(pre, use_regex=True):
        return
    if isinstance(pre, dict) and pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        if len(steps) == 1 and _is_byte_level(steps[0], use_regex=True):
            return
        if (
            len(steps) == 2
            and steps[0].get("type") == "Split"
            and steps[0].get("pattern") == {"Regex": GPT2_PATTERN}
            and steps[0].get("behavior") == "Isolated"
            and steps[0].get("invert") is False
            and _is_byte_level(steps[1], use_regex=False)
        ):
            return
    desc = json.dumps(pre)[:160] if pre is not None else "none"
    raise NotEquivalent(
        "pre-tokenizer is not the GPT-2 byte-level split (ByteLevel with use_regex=true and "
        f"add_prefix_space=false, or Split on the GPT-2 pattern then ByteLevel without regex): {desc}"
    )


def _token_bytes(token: str, alphabet: dict[str, int]) -> bytes | None:
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return None


def compile_bpe(tokenizer_json: str) -> CompiledBPE:
    """The tokenizer as tiktoken ranks, or `NotEquivalent` naming the first condition (C0-C3 in the
    module docstring) that fails."""
    try:
        spec = _model_spec(tokenizer_json)
    except Exception as exc:  # noqa: BLE001 - an unreadable tokenizer is simply not compilable
        raise NotEquivalent(f"tokenizers cannot load it: {exc}") from None
    _check_pipeline(spec)
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    specials = {t["content"]: int(t["id"]) for t in spec.get("added_tokens") or []}
    special_ids = set(specials.values())

    # C1: byte-level vocabulary with every byte.
    alphabet = byte_level_alphabet()
    ranks: dict[bytes, int] = {}
    for token, idx in vocab.items():
        if idx in special_ids or token in specials:
            continue
        b = _token_bytes(token, alphabet)
        if b is None:
            raise NotEquivalent(f"vocabulary entry {token!r} (id {idx}) is not in the byte-level alphabet")
        ranks[b] = idx  # the alphabet is a bijection, so distinct entries have distinct bytes
    if len(set(ranks.values())) != len(ranks):
        raise NotEquivalent("two vocabulary entries share an id")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise NotEquivalent(f"{len(missing)} of the 256 single bytes are not tokens (e.g. byte {missing[0]})")

    # C2: merges in id order, one per result.
    last = -1
    made: set[str] = set()
    for i, merge in enumerate(model.get("merges") or []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        ia, ib, result = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or result is None:
            raise NotEquivalent(f"merge {i} ({a!r}, {b!r}) names a token missing from the vocabulary")
        if result in special_ids or a in specials or b in specials:
            raise NotEquivalent(f"merge {i} ({a!r}, {b!r}) involves an added token")
        if not (result > ia and result > ib):
            raise NotEquivalent(f"merge {i} ({a!r}, {b!r}) makes id {result}, not greater than its parts {ia}, {ib}")
        if result <= last:
            raise NotEquivalent(
                f"merge {i} ({a!r}, {b!r}) makes id {result} after a merge that made id {last}: "
                "token id order is not merge order (tiktoken ranks pairs by token id)"
            )
        last = result
        made.add(a + b)

    # C3: every multi-byte token is what tokenizers' BPE makes of its own bytes.
    multi = [t for t, idx in vocab.items() if idx not in special_ids and t not in specials and len(t) > 1]
    unmade = [t for t in multi if t not in made]
    if unmade:
        raise NotEquivalent(f"vocabulary entry {unmade[0]!r} is made by no merge ({len(unmade)} such entries)")
    bad = _self_inconsistent(spec, multi)
    if bad is not None:
        token, got = bad
        raise NotEquivalent(f"tokenizers' BPE splits the token {token!r} itself into {got!r}")
    return CompiledBPE(ranks=ranks, pattern=GPT2_PATTERN, special_tokens=specials)


def _self_inconsistent(spec: dict[str, Any], tokens: list[str]) -> tuple[str, list[str]] | None:
    """The first token that tokenizers' BPE model does not map to itself, with what it gave."""
    from tokenizers import Tokenizer

    # The bare model: no pre-tokenizer, normalizer, post-processor or added tokens, so each string
    # (already in byte-level characters) goes through BPE as one word.
    bare = dict(spec, normalizer=None, pre_tokenizer=None, post_processor=None, added_tokens=[], decoder=None)
    model = Tokenizer.from_str(json.dumps(bare))
    vocab = spec["model"]["vocab"]
    for start in range(0, len(tokens), 4096):
        chunk = tokens[start : start + 4096]
        for token, enc in zip(chunk, model.encode_batch_fast(chunk, add_special_tokens=False)):
            if enc.ids != [vocab[token]]:
                return token, enc.tokens
    return None


@lru_cache(maxsize=2)
def try_compile(tokenizer_json: str) -> tuple[CompiledBPE | None, str]:
    """(compiled, "") or (None, the reason it is not provably equivalent). Kept for the last two texts: a run's
    driver checks the tokenizer before any work and again when it hands the proof to the tokenize tasks."""
    try:
        return compile_bpe(tokenizer_json), ""
    except NotEquivalent as exc:
        return None, str(exc)


def reference_tokenizer(tokenizer_json: str):
    """`tokenizers`' tokenizer as datapipe encodes with it: special-token text inside a document is
    plain text (never the special id), exactly like tiktoken's `encode_ordinary`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.encode_special_tokens = True
    return tokenizer


@dataclass(frozen=True)
class Mismatch:
    """The first document whose ids differ, and where."""

    index: int
    doc_id: str
    position: int  # first differing token
    expected: list[int]  # tokenizers' ids around it
    got: list[int]  # the fast encoder's ids around it

    def describe(self) -> str:
        return (
            f"document {self.doc_id!r} (#{self.index} of the sample) differs at token {self.position}: "
            f"tokenizers {self.expected} vs fast {self.got}"
        )


def compare(
    expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]], doc_ids: Sequence[str] | None = None
) -> Mismatch | None:
    """The first document whose two id lists differ, or None."""
    for i, (e, g) in enumerate(zip(expected, got)):
        e = list(e)
        g = list(g)
        if e != g:
            pos = next((k for k, (x, y) in enumerate(zip(e, g)) if x != y), min(len(e), len(g)))
            name = str(doc_ids[i]) if doc_ids is not None else str(i)
            return Mismatch(i, name, pos, e[max(0, pos - 2) : pos + 3], g[max(0, pos - 2) : pos + 3])
    return None


def first_mismatch(reference, fast: FastEncoder, texts: Sequence[str], doc_ids: Sequence[str] | None = None) -> Mismatch | None:
    """Encode `texts` with both (reference: from `reference_tokenizer`) and return the first
    difference, or None when every document gets identical ids."""
    expected = [e.ids for e in reference.encode_batch_fast(list(texts), add_special_tokens=False)]
    return compare(expected, fast.encode_batch(texts), doc_ids)


def tokenizers_classes(code_points: Sequence[int]) -> np.ndarray:
    """Each code point's class under `tokenizers`' ByteLevel pre-tokenizer (Oniguruma's GPT-2 split): a word-level
    model gives one id per piece."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from stages.fast_bpe_kernels import classes_from_probes

    splitter = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    splitter.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return classes_from_probes(
        code_points, lambda tests: [len(e.ids) == 1 for e in splitter.encode_batch_fast(tests, add_special_tokens=False)])


def regex_disagreements(code_points: Sequence[int]) -> dict[str, list[int]]:
    """Code points whose class the two regex engines see differently, per class the GPT-2 pattern
    uses: letter (`\\p{L}`), number (`\\p{N}`) and white space (`\\s`). Surrogates are skipped."""
    from stages.fast_bpe_kernels import LETTER, NUMBER, SPACE, tiktoken_classes

    points = [c for c in code_points if not 0xD800 <= c <= 0xDFFF]
    ours, theirs = tokenizers_classes(points), tiktoken_classes(points, GPT2_PATTERN)
    return {name: [c for c, a, b in zip(points, ours, theirs) if (a == kind) != (b == kind)]
            for name, kind in (("letter", LETTER), ("number", NUMBER), ("space", SPACE))}


__all__ = [
    "GPT2_PATTERN",
    "CompiledBPE",
    "FastEncoder",
    "Mismatch",
    "NotEquivalent",
    "byte_level_alphabet",
    "compare",
    "compile_bpe",
    "first_mismatch",
    "regex_disagreements",
    "tokenizers_classes",
    "reference_tokenizer",
    "try_compile",
]
