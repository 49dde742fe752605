"""The quality filters as plain Python: the reference that `stages.quality`'s compiled kernels must equal.

This is the code `stages.quality` ran before its checks were compiled (`stages.quality_kernels`), kept
unchanged so that tests (and `scripts/bench_filters`) can compare every document's decision and reason with
it. It lives under tests/ so that no recipe can select it. Each class takes the config of its namesake in
`stages.quality` and has its `name` and `check(text)`.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter
from itertools import accumulate, compress, count, repeat
from operator import add, mul
from typing import Any, ClassVar, Iterator

from stages.quality import (
    C4Config,
    CodeConfig,
    FineWebConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
)

# A word (letters/digits/underscore, optionally joined by - ' ’ .) or a run of other symbols.
_TOKEN_RE = re.compile(r"\w+(?:[-'’.]\w+)*|[^\w\s]+")
_HAS_ALNUM_RE = re.compile(r"\w")
_HAS_ALPHA_RE = re.compile(r"[^\W\d_]")


def tokenize(text: str) -> list[str]:
    """Word and symbol tokens of `text` (see the module docstring)."""
    return _TOKEN_RE.findall(text)


def _frac(num: float, den: float) -> float:
    """num / den, with 0 for an empty denominator (an empty document has nothing to count)."""
    return num / den if den else 0.0


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items equal to an earlier one, their total characters) — datatrove's find_duplicates."""
    dup_items = dup_chars = 0
    for item, count in Counter(items).items():
        if count > 1:
            dup_items += count - 1
            dup_chars += (count - 1) * len(item)
    return dup_items, dup_chars


# --------------------------------------------------------------------------------------------------
# gopher_quality

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")  # Gopher's list, as in datatrove


class GopherQualityFilter:
    name: ClassVar[str] = "gopher_quality"

    def __init__(self, config: GopherQualityConfig) -> None:
        self.config = config
        self._stop_words = frozenset(config.stop_words)

    def check(self, text: str) -> str | None:
        c = self.config
        if not c.enabled:
            return None
        tokens = tokenize(text)
        n_tokens = len(tokens)
        words = [t for t in tokens if _HAS_ALNUM_RE.match(t)]  # a token starting with \w is a word token
        n_words = len(words)

        if c.min_doc_words is not None and n_words < c.min_doc_words:
            return "word_count"
        if c.max_doc_words is not None and n_words > c.max_doc_words:
            return "word_count"

        mean_len = _frac(sum(map(len, words)), n_words)
        if c.min_avg_word_length is not None and mean_len < c.min_avg_word_length:
            return "mean_word_length"
        if c.max_avg_word_length is not None and mean_len > c.max_avg_word_length:
            return "mean_word_length"

        if c.max_symbol_word_ratio is not None:
            if _frac(text.count("#"), n_tokens) > c.max_symbol_word_ratio:
                return "hash_ratio"
            if _frac(text.count("...") + text.count("…"), n_tokens) > c.max_symbol_word_ratio:
                return "ellipsis_ratio"

        if c.max_bullet_lines_ratio is not None or c.max_ellipsis_lines_ratio is not None:
            lines = text.splitlines()
            if c.max_bullet_lines_ratio is not None:
                bullets = sum(1 for s in lines if s.lstrip().startswith(("•", "-")))
                if _frac(bullets, len(lines)) > c.max_bullet_lines_ratio:
                    return "bullet_lines"
            if c.max_ellipsis_lines_ratio is not None:
                ellipses = sum(1 for s in lines if s.rstrip().endswith(("...", "…")))
                if _frac(ellipses, len(lines)) > c.max_ellipsis_lines_ratio:
                    return "ellipsis_lines"

        if c.min_alpha_words_ratio is not None:
            alpha = sum(1 for t in tokens if _HAS_ALPHA_RE.search(t))
            if _frac(alpha, n_tokens) < c.min_alpha_words_ratio:
                return "alpha_words"

        if c.min_stop_words is not None:
            if sum(map(self._stop_words.__contains__, tokens)) < c.min_stop_words:
                return "stop_words"
        return None


# --------------------------------------------------------------------------------------------------
# gopher_repetition

_PARAGRAPH_SPLIT_RE = re.compile(r"\n{2,}")
_LINE_SPLIT_RE = re.compile(r"\n+")
_TOP_NS = (2, 3, 4)
_DUP_NS = (5, 6, 7, 8, 9, 10)


def _repeated_ngrams(tokens: list[str], max_n: int) -> Iterator[tuple[int, Counter[int], list[int], list[int]]]:
    """For n = 2..max_n: (n, counts of n-gram ids, ids of the n-grams that occur twice or more, their
    start positions), in text order. Equal n-grams get equal ids (small ints, cheaper than tuples).

    An n-gram can repeat only where the (n-1)-gram it starts with repeats, so each n extends only the
    previous n's repeated positions: the work shrinks as n grows instead of recounting every position.
    The loops are map/compress chains because this runs over every token several times.
    """
    n_tokens = len(tokens)
    ids: list[int] = list(map({}.setdefault, tokens, count()))  # same token, same id (< n_tokens)
    keys, starts = ids, list(range(n_tokens))
    for n in range(2, max_n + 1):
        keep = bisect_right(starts, n_tokens - n)  # starts ascend; later ones run off the end
        starts = starts[:keep]
        next_ids = map(ids.__getitem__, map(add, starts, repeat(n - 1)))
        pairs = map(add, map(mul, keys[:keep], repeat(n_tokens)), next_ids)  # (n-1)-gram id, next token id
        keys = list(map({}.setdefault, pairs, count()))  # back to small ids (< n_tokens)
        counts = Counter(keys)
        repeated = list(map((1).__lt__, map(counts.__getitem__, keys)))
        keys = list(compress(keys, repeated))
        starts = list(compress(starts, repeated))
        yield n, counts, keys, starts


def _top_ngram_chars(n: int, counts: Counter[int], keys: list[int], starts: list[int], prefix: list[int]) -> int:
    """Characters of the most frequent n-gram (joined by spaces, as datatrove) times its count.

    An n-gram seen once is not a repetition and counts 0 (datatrove counts it; see the module note).
    """
    if not keys:
        return 0
    key, times = counts.most_common(1)[0]  # ties: the first in the text, as datatrove
    i = starts[keys.index(key)]
    return (prefix[i + n] - prefix[i] + n - 1) * times


def _dup_ngram_chars(n: int, keys: list[int], starts: list[int], prefix: list[int]) -> int:
    """Characters (spaces excluded) of n-grams that repeat an earlier one, scanning as datatrove does:
    left to right, a repeat adds its characters and jumps n tokens ahead (so repeats never overlap),
    anything else is remembered and the scan moves one token.

    Only positions whose n-gram occurs twice or more (`keys`, `starts`) can change the result: an
    n-gram seen once is never a repeat and never makes the scan jump.
    """
    seen: set[int] = set()
    chars = 0
    resume = 0  # positions before this were jumped over
    for key, i in zip(keys, starts):
        if i < resume:
            continue
        if key in seen:
            chars += prefix[i + n] - prefix[i]
            resume = i + n
        else:
            seen.add(key)
    return chars


class GopherRepetitionFilter:
    name: ClassVar[str] = "gopher_repetition"

    def __init__(self, config: GopherRepetitionConfig) -> None:
        self.config = config
        # n -> (threshold, "top" or "dup") for the n-gram checks that are on
        self._ngram_checks: dict[int, tuple[float, str]] = {}
        for n in _TOP_NS:
            if (limit := getattr(config, f"top_{n}gram_frac")) is not None:
                self._ngram_checks[n] = (limit, "top")
        for n in _DUP_NS:
            if (limit := getattr(config, f"dup_{n}gram_frac")) is not None:
                self._ngram_checks[n] = (limit, "dup")

    def check(self, text: str) -> str | None:
        c = self.config
        if not c.enabled or not text:
            return None
        n_chars = len(text)

        paragraphs = _PARAGRAPH_SPLIT_RE.split(text.strip())
        dup_paras, dup_para_chars = _duplicates(paragraphs)
        if c.dup_para_frac is not None and dup_paras / len(paragraphs) > c.dup_para_frac:
            return "dup_para_frac"
        if c.dup_para_char_frac is not None and dup_para_chars / n_chars > c.dup_para_char_frac:
            return "dup_para_char_frac"

        lines = _LINE_SPLIT_RE.split(text)
        dup_lines, dup_line_chars = _duplicates(lines)
        if c.dup_line_frac is not None and dup_lines / len(lines) > c.dup_line_frac:
            return "dup_line_frac"
        if c.dup_line_char_frac is not None and dup_line_chars / n_chars > c.dup_line_char_frac:
            return "dup_line_char_frac"

        if not self._ngram_checks:
            return None
        tokens = tokenize(text)
        prefix = [0, *accumulate(map(len, tokens))]  # characters of the tokens before position i
        for n, counts, keys, starts in _repeated_ngrams(tokens, max(self._ngram_checks)):
            if n not in self._ngram_checks:
                continue
            limit, kind = self._ngram_checks[n]
            if kind == "top":
                if _top_ngram_chars(n, counts, keys, starts, prefix) / n_chars > limit:
                    return f"top_{n}gram"
            elif _dup_ngram_chars(n, keys, starts, prefix) / n_chars > limit:
                return f"dup_{n}gram"
        return None


# --------------------------------------------------------------------------------------------------
# c4

_CITATION_RE = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
_POLICY_SUBSTRINGS = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
# A sentence ends at terminal punctuation (and closing quotes/brackets) followed by the end of the
# line, or by whitespace and a character that is not a lowercase letter ("e.g. this" is one sentence).
_SENTENCE_END_RE = re.compile(r"[.!?…]+['\"”’)\]]*(?:\s+(?=[^\sa-z])|\s*$)")


class C4Filter:
    """C4's line rules, used to decide whether a document is kept; kept documents are not edited."""

    name: ClassVar[str] = "c4"

    def __init__(self, config: C4Config) -> None:
        self.config = config

    def check(self, text: str) -> str | None:
        c = self.config
        if not c.enabled:
            return None
        sentences = 0
        for line in text.splitlines():
            line = line.strip()
            words = line.split()  # before citations are removed, as datatrove
            if c.max_word_length is not None and any(len(w) > c.max_word_length for w in words):
                continue
            if c.remove_citations:
                line = _CITATION_RE.sub("", line)
            if c.filter_no_terminal_punct and (not line.endswith(_C4_END_PUNCTUATION) or line.endswith("...")):
                continue
            if c.min_words_per_line is not None and len(words) < c.min_words_per_line:
                continue
            lower = line.lower()
            if c.filter_lorem_ipsum and "lorem ipsum" in lower:
                return "lorem_ipsum"
            if c.filter_javascript and "javascript" in lower:
                continue
            if c.filter_curly_bracket and "{" in line:
                return "curly_bracket"
            if c.filter_policy and any(p in lower for p in _POLICY_SUBSTRINGS):
                continue
            sentences += max(1, len(_SENTENCE_END_RE.findall(line))) if line else 0
        if c.min_num_sentences is not None and sentences < c.min_num_sentences:
            return "too_few_sentences"
        return None


# --------------------------------------------------------------------------------------------------
# fineweb

_FINEWEB_STOP_CHARS = (".", "'", '"', "!", "?")


class FineWebFilter:
    name: ClassVar[str] = "fineweb"

    def __init__(self, config: FineWebConfig) -> None:
        self.config = config

    def check(self, text: str) -> str | None:
        c = self.config
        if not c.enabled:
            return None
        lines = text.split("\n")  # not stripped, as datatrove: trailing spaces hide the punctuation
        n_lines = len(lines)
        if c.line_punct_thr is not None:
            ratio = sum(1 for s in lines if s.endswith(_FINEWEB_STOP_CHARS)) / n_lines
            if ratio <= c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero):
                return "line_punct_ratio"
        if c.short_line_thr is not None:
            ratio = sum(1 for s in lines if len(s) <= c.short_line_length) / n_lines
            if ratio >= c.short_line_thr:
                return "short_line_ratio"
        if c.char_duplicates_ratio is not None:
            _, dup_chars = _duplicates([s for s in lines if s.strip()])
            if _frac(dup_chars, len(text) - (n_lines - 1)) >= c.char_duplicates_ratio:
                return "char_dup_ratio"
        if c.new_line_ratio is not None:
            if _frac(n_lines - 1, len(tokenize(text))) > c.new_line_ratio:
                return "list_ratio"
        return None


# --------------------------------------------------------------------------------------------------
# code

AUTOGENERATED_MARKERS = ("auto-generated", "autogenerated", "automatically generated", "generated by", "do not edit")


class CodeFilter:
    name: ClassVar[str] = "code"

    def __init__(self, config: CodeConfig) -> None:
        self.config = config
        self._markers = tuple(m.lower() for m in config.autogenerated_markers)

    def check(self, text: str) -> str | None:
        c = self.config
        if not c.enabled:
            return None
        lengths = [len(s) for s in text.splitlines()]
        if c.max_line_length is not None and max(lengths, default=0) > c.max_line_length:
            return "max_line_length"
        if c.max_mean_line_length is not None and _frac(sum(lengths), len(lengths)) > c.max_mean_line_length:
            return "mean_line_length"
        if c.min_alphanum_fraction is not None:
            if _frac(sum(map(str.isalnum, text)), len(text)) < c.min_alphanum_fraction:
                return "alphanum_fraction"
        if self._markers and c.autogenerated_scan_lines > 0:
            head = "\n".join(text.splitlines()[: c.autogenerated_scan_lines]).lower()
            if any(m in head for m in self._markers):
                return "autogenerated"
        return None


REFERENCE_FILTERS: dict[str, type[Any]] = {
    f.name: f for f in (GopherQualityFilter, GopherRepetitionFilter, C4Filter, FineWebFilter, CodeFilter)
}
