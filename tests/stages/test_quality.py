"""Tests for stages/quality.py: every check passes and fails where it should, thresholds and config errors."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from datapipe.core.config import ConfigError
from datapipe.core.schema import DOC_SCHEMA
from datapipe.testing.quality_reference import REFERENCE_FILTERS
from stages.base import FilterStage
from stages.quality import (
    FILTERS,
    C4Config,
    C4Filter,
    CodeConfig,
    CodeFilter,
    FineWebConfig,
    FineWebFilter,
    GopherQualityConfig,
    GopherQualityFilter,
    GopherRepetitionConfig,
    GopherRepetitionFilter,
    build_filters,
    tokenize,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"

SENTENCES = [
    "The river that runs past the old mill has been rising with every storm this spring.",
    "Farmers along the valley say the water reached the lower fields twice in April.",
    "Engineers from the county office plan to inspect the levee before the summer rains begin.",
    "A small museum in the mill tells the story of the families who built it in 1820.",
    "Visitors can walk the towpath and watch herons fishing in the shallow pools at dusk.",
    "Volunteers repaint the wooden footbridge each autumn and replace any rotten planks.",
    "Local schools bring children here to learn how grain was ground before electricity.",
    "Most people agree the place is worth protecting for the generations still to come.",
]
PROSE = "\n".join(SENTENCES)  # passes every filter with its defaults


def gq(text: str, **params: Any) -> str | None:
    return GopherQualityFilter(GopherQualityConfig(**params)).check(text)


def rep(text: str, **params: Any) -> str | None:
    return GopherRepetitionFilter(GopherRepetitionConfig(**params)).check(text)


def c4(text: str, **params: Any) -> str | None:
    return C4Filter(C4Config(**params)).check(text)


def fw(text: str, **params: Any) -> str | None:
    return FineWebFilter(FineWebConfig(**params)).check(text)


def code(text: str, **params: Any) -> str | None:
    return CodeFilter(CodeConfig(**params)).check(text)


def test_prose_passes_every_filter_with_defaults() -> None:
    for name, (config_cls, filter_cls) in FILTERS.items():
        if name != "code":  # prose is not code, but it passes that too
            assert filter_cls(config_cls()).check(PROSE) is None, name
    assert code(PROSE) is None


def test_tokenize() -> None:
    assert tokenize("Don't stop -- well-known e.g. 3.14 ... #tag!") == [
        "Don't", "stop", "--", "well-known", "e.g", ".", "3.14", "...", "#", "tag", "!",
    ]


# --------------------------------------------------------------------------------------------------
# gopher_quality

NATO = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
        "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@pytest.mark.parametrize(
    "text, params, reason",
    [
        ("The cat sat on the mat.", {}, "word_count"),
        (PROSE, {"min_doc_words": None, "max_doc_words": 20}, "word_count"),
        (" ".join(["ab", "to", "of"] * 30), {}, "mean_word_length"),
        (" ".join(["extraordinarily"] * 60), {}, "mean_word_length"),
        (PROSE + " #" * 20, {}, "hash_ratio"),
        (PROSE + " ..." * 20, {}, "ellipsis_ratio"),
        (PROSE + " …" * 20, {}, "ellipsis_ratio"),
        ("\n".join("- " + s for s in SENTENCES), {}, "bullet_lines"),
        ("\n".join("  • " + s for s in SENTENCES), {}, "bullet_lines"),
        ("\n".join(s[:-1] + "..." for s in SENTENCES), {}, "ellipsis_lines"),
        (PROSE + " " + " ".join(str(100 + i) for i in range(60)), {}, "alpha_words"),
        (" ".join(NATO * 3), {}, "stop_words"),
        (PROSE.replace("the", "a").replace("The", "A"), {"min_stop_words": 100}, "stop_words"),
    ],
)
def test_gopher_quality_fails(text: str, params: dict, reason: str) -> None:
    assert gq(text, **params) == reason


def test_gopher_quality_passes_near_the_edges() -> None:
    assert gq(PROSE + " #" * 5) is None  # a few hashes
    assert gq("\n".join(["- " + s for s in SENTENCES[:7]] + [SENTENCES[7]])) is None  # 7/8 bullets < 0.9
    assert gq(" ".join(NATO * 3) + " the and") is None  # exactly two stop words


def test_gopher_quality_zero_is_a_threshold_and_null_disables() -> None:
    text = PROSE + " #"
    assert gq(text) is None
    assert gq(text, max_symbol_word_ratio=0) == "hash_ratio"  # datatrove would treat 0 as "off"
    assert gq(text, max_symbol_word_ratio=None) is None
    assert gq(PROSE, min_doc_words=0, max_doc_words=0) == "word_count"
    assert gq("", min_doc_words=None, min_avg_word_length=None, min_alpha_words_ratio=None, min_stop_words=None) is None
    bullets = "\n".join("- " + s for s in SENTENCES)
    assert gq(bullets, max_bullet_lines_ratio=None) is None
    assert gq(" ".join(NATO * 3), min_stop_words=None) is None
    assert gq(" ".join(NATO * 3), min_stop_words=0) is None  # 0 stop words is not fewer than 0


def test_gopher_quality_validation() -> None:
    with pytest.raises(ConfigError, match=r"min_doc_words must be >= 0.*-1"):
        GopherQualityConfig(min_doc_words=-1)
    with pytest.raises(ConfigError, match=r"min_doc_words must be <= max_doc_words"):
        GopherQualityConfig(min_doc_words=10, max_doc_words=5)
    with pytest.raises(ConfigError, match=r"max_bullet_lines_ratio must be a fraction in \[0, 1\].*1.5"):
        GopherQualityConfig(max_bullet_lines_ratio=1.5)


# --------------------------------------------------------------------------------------------------
# gopher_repetition

def unique_words(count: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(count)]


ALL_NGRAMS_OFF = {f.name: None for f in fields(GopherRepetitionConfig) if "gram" in f.name}


@pytest.mark.parametrize(
    "text, reason",
    [
        ("First paragraph.\n\nSecond one.\n\nFirst paragraph.\n\nFirst paragraph.", "dup_para_frac"),
        ("A rather long paragraph that repeats itself once in this text." * 3
         + "\n\nshort\n\nother\n\n" + "A rather long paragraph that repeats itself once in this text." * 3,
         "dup_para_char_frac"),
        ("one line\ntwo line\none line\none line", "dup_line_frac"),
        ("a long line that is repeated exactly once here\nb\nc\na long line that is repeated exactly once here",
         "dup_line_char_frac"),
    ],
)
def test_gopher_repetition_paragraphs_and_lines(text: str, reason: str) -> None:
    assert rep(text) == reason


@pytest.mark.parametrize("n", [2, 3, 4])
def test_gopher_repetition_top_ngram(n: int) -> None:
    gram = unique_words(n, "g")
    words: list[str] = []
    for filler in unique_words(20):
        words += gram + [filler]
    only = {**ALL_NGRAMS_OFF, f"top_{n}gram_frac": getattr(GopherRepetitionConfig(), f"top_{n}gram_frac")}
    assert rep(" ".join(words), **only) == f"top_{n}gram"
    assert rep(" ".join(unique_words(100)), **only) is None
    assert rep(" ".join(words), **{**only, f"top_{n}gram_frac": None}) is None


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 10])
def test_gopher_repetition_dup_ngram(n: int) -> None:
    block = unique_words(n, "b")
    words = block + unique_words(n) + block
    only = {**ALL_NGRAMS_OFF, f"dup_{n}gram_frac": getattr(GopherRepetitionConfig(), f"dup_{n}gram_frac")}
    assert rep(" ".join(words), **only) == f"dup_{n}gram"
    assert rep(" ".join(unique_words(3 * n)), **only) is None
    # the same words, repeated one short of n: no n-gram repeats
    short = block[:-1] + unique_words(n) + block[:-1]
    assert rep(" ".join(short), **only) is None


def test_gopher_repetition_defaults_in_order_and_thresholds() -> None:
    # three distinct 5-word blocks each repeated once, in enough unique text that no top n-gram trips
    blocks = [unique_words(5, p) for p in "abc"]
    words = [w for b in blocks for w in b] + unique_words(30) + [w for b in blocks for w in b]
    assert rep(" ".join(words)) == "dup_5gram"
    text = PROSE + "\n" + SENTENCES[0]  # one repeated line of nine
    assert rep(text) is None
    assert rep(text, dup_line_frac=0) == "dup_line_frac"
    assert rep(text, dup_line_frac=None, dup_line_char_frac=0) == "dup_line_char_frac"
    assert rep("") is None
    assert rep("Hello world") is None  # a lone 2-gram is not a repetition (datatrove would drop it)


def _reference_top(words: list[str], n: int) -> int:
    grams = [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0
    gram, count = Counter(grams).most_common(1)[0]
    return len(gram) * count if count > 1 else 0


def _reference_dup(words: list[str], n: int) -> int:
    seen, chars, i = set(), 0, 0
    while i < len(words) - n + 1:
        gram = "".join(words[i : i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def test_gopher_repetition_ngram_fast_path_matches_datatrove_scan() -> None:
    """The reference's candidate-only scan gives exactly the counts of datatrove's plain loop."""
    from itertools import accumulate

    from datapipe.testing.quality_reference import _dup_ngram_chars, _repeated_ngrams, _top_ngram_chars

    rng = random.Random(0)
    for trial in range(200):
        vocab = ["a", "bb", "ccc", "dddd", "e", "ff"][: rng.randint(1, 6)]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 80))]
        prefix = [0, *accumulate(map(len, words))]
        got_top, got_dup = {}, {}
        for n, counts, keys, starts in _repeated_ngrams(words, 10):
            got_top[n] = _top_ngram_chars(n, counts, keys, starts, prefix)
            got_dup[n] = _dup_ngram_chars(n, keys, starts, prefix)
        for n in range(2, 11):
            assert got_top.get(n, 0) == _reference_top(words, n), (trial, n)
            assert got_dup.get(n, 0) == _reference_dup(words, n), (trial, n)


# --------------------------------------------------------------------------------------------------
# c4

def test_c4_document_rules() -> None:
    assert c4(PROSE) is None
    assert c4("\n".join(SENTENCES[:4])) == "too_few_sentences"
    assert c4("\n".join(SENTENCES[:4]), min_num_sentences=4) is None
    assert c4("\n".join(SENTENCES[:4]), min_num_sentences=None) is None
    assert c4("", min_num_sentences=0) is None
    assert c4("", min_num_sentences=1) == "too_few_sentences"
    # several sentences on one line count; an abbreviation before a lowercase word does not end one
    assert c4("One thing here. Two things here! Three? Four is here. Five is the last.") is None
    assert c4("One e.g. this. Two things here! Three? Four is here.") == "too_few_sentences"

    lorem = PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit."
    assert c4(lorem) == "lorem_ipsum"
    assert c4(lorem, filter_lorem_ipsum=False) is None
    assert c4(PROSE + "\nlorem ipsum dolor sit amet") is None  # that line is removed first (no punctuation)
    curly = PROSE + "\nThe value of the field is {x} here."
    assert c4(curly) == "curly_bracket"
    assert c4(curly, filter_curly_bracket=False) is None


@pytest.mark.parametrize(
    "bad_line, flag",
    [
        ("This line has no terminal punctuation", {"filter_no_terminal_punct": False}),
        ("This line trails off...", {"filter_no_terminal_punct": False}),
        ("Too short.", {"min_words_per_line": None}),
        ("Please enable JavaScript to view this page.", {"filter_javascript": False}),
        ("Read our privacy policy before you continue.", {"filter_policy": False}),
        ("This site uses cookies to improve your experience.", {"filter_policy": False}),
        ("A word " + "x" * 1001 + " is far too long.", {"max_word_length": None}),
        ("A cited claim that ends in a reference.[citation needed]", {"remove_citations": True}),
    ],
)
def test_c4_line_rules_remove_lines(bad_line: str, flag: dict) -> None:
    text = "\n".join(SENTENCES[:4] + [bad_line])
    if flag == {"remove_citations": True}:  # the citation is stripped, then the line counts
        assert c4(text) is None
        assert c4(text, remove_citations=False) == "too_few_sentences"
        return
    assert c4(text) == "too_few_sentences"  # the bad line was removed: four sentences left
    assert c4(text, **flag) is None


def test_c4_validation() -> None:
    with pytest.raises(ConfigError, match=r"min_num_sentences must be >= 0.*-1"):
        C4Config(min_num_sentences=-1)


# --------------------------------------------------------------------------------------------------
# fineweb

def test_fineweb_checks() -> None:
    no_punct = "\n".join(s.rstrip(".") for s in SENTENCES)
    assert fw(no_punct) == "line_punct_ratio"
    assert fw(no_punct, line_punct_exclude_zero=True) is None
    assert fw(no_punct, line_punct_thr=None) is None
    one_punct = "\n".join(s.rstrip(".") for s in SENTENCES[:7]) + "\n" + SENTENCES[7]
    assert fw(one_punct) is None  # 1/8 = 0.125 > 0.12
    assert fw(one_punct, line_punct_thr=0.125) == "line_punct_ratio"  # <= drops, as datatrove

    short = "\n".join(f"Short line number {i}." for i in range(10))
    assert fw(short) == "short_line_ratio"
    assert fw(short, short_line_length=10) is None
    assert fw(short, short_line_thr=None) is None

    dup = PROSE + "\n" + SENTENCES[3]
    assert fw(dup) == "char_dup_ratio"
    assert fw(dup, char_duplicates_ratio=None) is None
    assert fw(PROSE + "\n\n\n") is None  # blank lines are not duplicates
    assert fw(PROSE, char_duplicates_ratio=0) == "char_dup_ratio"  # 0 >= 0: zero means zero

    listy = "\n".join(f"Pneumonoultramicroscopicsilicovolcanoconiosis{i}." for i in range(10))  # 9 newlines, 20 tokens
    assert fw(listy) == "list_ratio"
    assert fw(listy, new_line_ratio=None) is None
    assert fw(listy, new_line_ratio=0.5) is None


# --------------------------------------------------------------------------------------------------
# code

GOOD_CODE = '''"""A small module."""

import os


def join(a: str, b: str) -> str:
    """Join two path parts."""
    return os.path.join(a, b)
'''


def test_code_checks() -> None:
    assert code(GOOD_CODE) is None
    long_line = GOOD_CODE + "x = '" + "a" * 1000 + "'\n"
    assert code(long_line) == "max_line_length"
    assert code(long_line, max_line_length=2000, max_mean_line_length=None) is None
    wide = "\n".join(f"value_{i} = compute(" + ", ".join(["argument"] * 14) + ")" for i in range(5))
    assert code(wide) == "mean_line_length"
    assert code(wide, max_mean_line_length=200) is None
    symbols = "{}[]();\n" * 50
    assert code(symbols) == "alphanum_fraction"
    assert code(symbols, min_alphanum_fraction=None) is None
    assert code("", min_alphanum_fraction=0) is None


@pytest.mark.parametrize(
    "header", ["# Auto-Generated file", "// AUTOGENERATED", "# Generated by protoc.", "# DO NOT EDIT"]
)
def test_code_autogenerated(header: str) -> None:
    assert code(header + "\n" + GOOD_CODE) == "autogenerated"
    assert code("\n" * 5 + header + "\n" + GOOD_CODE) is None  # only the first 5 lines are scanned
    assert code("\n" * 5 + header + "\n" + GOOD_CODE, autogenerated_scan_lines=6) == "autogenerated"
    assert code(header + "\n" + GOOD_CODE, autogenerated_markers=()) is None
    assert code("# made by hand\n" + GOOD_CODE, autogenerated_markers=("MADE BY",)) == "autogenerated"


# --------------------------------------------------------------------------------------------------
# build_filters and config errors

def test_build_filters_defaults_order_and_enabled() -> None:
    per_domain, default = build_filters({
        "web": {"fineweb": None, "gopher_quality": {}, "c4": {"min_num_sentences": 2}},
        "code": {"code": {"max_line_length": 500}, "gopher_repetition": {"enabled": False}},
        "man": {"gopher_quality": {"enabled": False}},
        "*": {"gopher_repetition": {}},
    })
    assert [f.name for f in per_domain["web"]] == ["fineweb", "gopher_quality", "c4"]
    assert per_domain["web"][0].config == FineWebConfig()
    assert per_domain["web"][2].config.min_num_sentences == 2
    assert [f.name for f in per_domain["code"]] == ["code"]
    assert per_domain["code"][0].config.max_line_length == 500
    assert per_domain["man"] == []  # configured with nothing on: no filters, not the "*" ones
    assert [f.name for f in default] == ["gopher_repetition"]
    assert "*" not in per_domain

    assert build_filters({}) == ({}, [])
    per_domain, default = build_filters({"web": {"code": {}}})
    assert default == [] and list(per_domain) == ["web"]


def test_yaml_params_are_converted() -> None:
    per_domain, _ = build_filters({"web": {"code": {"autogenerated_markers": ["x"], "max_mean_line_length": 50}}})
    (flt,) = per_domain["web"]
    assert flt.config.autogenerated_markers == ("x",)
    assert flt.config.max_mean_line_length == 50.0


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ({"web": {"foo": {}}}, r"unknown filter 'filters\.web\.foo'; allowed: \['c4', 'code', 'fineweb', 'gopher_quality', 'gopher_repetition'\]"),
        ({"web": {"gopher_quality": {"min_doc_word": 5}}}, r"'filters\.web\.gopher_quality\.min_doc_word'"),
        ({"web": {"gopher_quality": {"min_doc_words": "many"}}}, r"'filters\.web\.gopher_quality\.min_doc_words' must be an integer, got 'many'"),
        ({"web": {"gopher_quality": {"min_doc_words": -1}}}, r"filters\.web\.gopher_quality\.min_doc_words'? must be >= 0 or null, got -1"),
        ({"*": {"gopher_repetition": {"top_2gram_frac": 2.0}}}, r"filters\.\*\.gopher_repetition\.top_2gram_frac'? must be a fraction in \[0, 1\] or null, got 2\.0"),
        ({"code": {"code": {"enabled": "yes"}}}, r"'filters\.code\.code\.enabled' must be true or false, got 'yes'"),
        ({"code": {"code": {"autogenerated_markers": "generated"}}}, r"'filters\.code\.code\.autogenerated_markers' must be a list"),
        ({"code": {"code": 5}}, r"'filters\.code\.code' must be a mapping, got 5"),
        ({"code": ["code"]}, r"'filters\.code' must be a mapping"),
    ],
)
def test_build_filters_errors_name_the_dotted_key(spec: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_filters(spec)


def test_load_config_validates_filters(tmp_path: Path) -> None:
    from datapipe.curation.config import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "inputs: [{path: data.jsonl}]\n"
        "filters:\n  web:\n    gopher_quality: {min_doc_words: 10}\n    fineweb: {}\n"
    )
    cfg = load_config(recipe)
    per_domain, _ = build_filters(cfg.filters)
    assert [f.name for f in per_domain["web"]] == ["gopher_quality", "fineweb"]
    # a --set mistake names the --set flag, not the recipe file (which holds no such value)
    with pytest.raises(ConfigError, match=r"^--set filters\.web\.gopher_quality\.min_doc_words=-5: .*min_doc_words'? must be >= 0"):
        load_config(recipe, overrides=["filters.web.gopher_quality.min_doc_words=-5"])
    with pytest.raises(ConfigError, match=r"unknown filter 'filters\.web\.nope'"):
        load_config(recipe, overrides=["filters.web.nope.x=1"])


# --------------------------------------------------------------------------------------------------
# FilterStage over a record batch

def test_filter_stage_per_domain_and_default() -> None:
    per_domain, default = build_filters({
        "web": {"gopher_quality": {}},
        "code": {"code": {}},
        "*": {"fineweb": {}},
    })
    rows = [
        ("w1", "web", PROSE),
        ("w2", "web", "Too short."),
        ("c1", "code", GOOD_CODE),
        ("c2", "code", "# autogenerated\n" + GOOD_CODE),
        ("c3", "code", "x = 1\n" * 3 + "y = '" + "z" * 1200 + "'\n"),
        ("o1", "other", PROSE),
        ("o2", "other", "\n".join(f"Tiny {i}." for i in range(9))),
        ("o3", "books", GOOD_CODE),  # no "books" entry: the "*" filters apply (fineweb drops short code lines)
    ]
    batch = pa.RecordBatch.from_pylist(
        [{"id": i, "domain": d, "text": t, "order": k} for k, (i, d, t) in enumerate(rows)], schema=DOC_SCHEMA
    )
    result = FilterStage(per_domain, default)(batch)
    assert result.kept.schema == DOC_SCHEMA
    assert result.kept.column("id").to_pylist() == ["w1", "c1", "o1"]
    dropped = dict(zip(result.dropped.column("id").to_pylist(), result.dropped.column("reason").to_pylist()))
    assert dropped == {
        "w2": "gopher_quality:word_count",
        "c2": "code:autogenerated",
        "c3": "code:max_line_length",
        "o2": "fineweb:short_line_ratio",
        "o3": "fineweb:short_line_ratio",
    }
    assert set(result.dropped.column("stage").to_pylist()) == {"filters"}
    assert result.dropped.column("order").to_pylist() == [1, 3, 4, 6, 7]


# --------------------------------------------------------------------------------------------------
# real documents (a slice of the shared corpus, copied into tests/assets)

def _sample() -> list[dict]:
    with open(ASSETS / "quality_sample.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_real_documents() -> None:
    docs = {d["id"]: d for d in _sample()}
    assert {d["source"] for d in docs.values()} == {"man", "license", "code"}

    code_filter = CodeFilter(CodeConfig())
    for doc_id in ("code/__future__.py", "code/bisect.py", "code/colorsys.py", "code/asyncio/queues.py"):
        assert code_filter.check(docs[doc_id]["text"]) is None, doc_id
    # two real generated stdlib files say so in their first lines
    assert code_filter.check(docs["code/token.py"]["text"]) == "autogenerated"
    assert code_filter.check(docs["code/keyword.py"]["text"]) == "autogenerated"

    gopher = GopherQualityFilter(GopherQualityConfig())
    for doc_id in ("license/base-files", "license/cpp", "license/gettext"):
        assert gopher.check(docs[doc_id]["text"]) is None, doc_id

    # every filter runs over every real document and answers None or a documented reason
    for config_cls, filter_cls in FILTERS.values():
        f = filter_cls(config_cls())
        for doc in docs.values():
            reason = f.check(doc["text"])
            assert reason is None or reason.replace("_", "").isalnum(), (f.name, doc["id"], reason)


# --------------------------------------------------------------------------------------------------
# the compiled filters against the Python reference: every decision and reason


def _adversarial_texts() -> list[str]:
    crlf = PROSE.replace("\n", "\r\n")
    return [
        "", " ", "\n", "\n\n\n", "\r\n", "\r", "\t \u3000\u00a0\n  \x1f", "a", ".", "...", "…", "#", "-", "•",
        "x" * 30_000,  # one huge line, one huge word
        "word " * 3_000, ("the same line\n" * 400), ("a paragraph here\n\n" * 200) + "end",
        PROSE + "\n" + "y" * 1_500 + " end.",  # a word past c4's max_word_length
        "NUL\x00bytes\x00in the\x00 text.\x00\n" * 20, "\x00" * 50,
        "Привет мир, как дела? Это тест. Всё хорошо!\n" * 5 + "你好，世界。这是测试。\n" + "مرحبا بالعالم. هذا اختبار.\n" * 3,
        "Mixed ελληνικά and English... and 日本語のテキスト! 😀😀 😀 emoji ✨.\n" * 6,
        crlf, crlf + "\r\n\r\n" + crlf, "line one\rline two\rline three.\r",
        "a\x0bb\x0cc\x1cd\x1de\x1ef\x85g\u2028h\u2029i.", "\n\n" + PROSE + "\n\n\n",
        "İSTANBUL LOREM İPSUM dolor sit amet is here today.\n" * 6, "LOREM IPSUM dolor sit amet, so they say.\n" * 6,
        "We use COOKIES here and the KELVIN \u212aelvin sign is odd, they say.\n" * 6,
        PROSE + "\nEnable JavaScript to see this page, please do.", PROSE + "\nThe {curly} bracket is in this line.",
        PROSE + "\nRead our privacy policy before you go on now.",
        "\n".join(s + " [1] [edit] [citation needed] [12a] [" for s in SENTENCES),
        "\n".join(s[:-1] + " [3]." for s in SENTENCES), "\n".join(s + " [edit]" for s in SENTENCES),
        "One e.g. this. Two! Three?! Four…” Five.) Six.] seven. Eight.\" nine", "end?!\"  \n  . a . B .",
        "\n".join("• item " + w for w in NATO), "\n".join("  - item " + w + "..." for w in NATO),
        "\n".join(w + " …" for w in NATO), "#hash #tags #everywhere " * 30, "don't well-known e.g. 3.14 ’tis a-b-c. x'y",
        "___ __init__ _x_ 123 4.5.6 ٣٤٥ ½ ² Ⅻ",
        " ".join(NATO * 4) + ".\n" + " ".join(NATO[:5] * 10) + ".",
        ("one two three four five six seven eight nine ten " * 12).strip(),
        "# Generated by a tool\n# do NOT edit\nimport os\n", "ΑΣ\n# generated by ς tool\n", "ΑΣΑ ΟΔΟΣ\nx = 1\n",
        "ΑΣ x = 1\ny = 2\n", "ΑΣΑ x = 1\n",  # lower() makes the first sigma final (ς), the second not (σ)
        "def f():\n    return {'a': 1}\n" * 40, "x = 1  # " + "z" * 1_200 + "\n",
    ]


def _random_texts(count: int) -> list[str]:
    """Short texts of a few words and separators: repeated n-grams, lines and paragraphs of every kind."""
    rng = random.Random(42)
    out = []
    for _ in range(count):
        vocab = ["a", "bb", "the", "of", "dddd", "e.g.", "and", "…", "#", "x-y"][: rng.randint(1, 10)]
        seps = [" ", " ", " ", "\n", "\n\n", ". ", "! ", "\r\n", " ... "][: rng.randint(1, 9)]
        out.append("".join(rng.choice(vocab) + rng.choice(seps) for _ in range(rng.randint(0, 120))))
    return out


def _texts() -> list[str]:
    assets = [json.loads(line)["text"] for name in ("quality_sample", "corpus_slice", "multilingual_sample",
                                                       "target_code") for line in (ASSETS / f"{name}.jsonl").open()]
    return assets + _adversarial_texts() + _random_texts(300)


# each filter with its defaults, then with one check at a time on (the others null), so that every check meets
# texts the earlier checks would have dropped
_OFF = {
    "gopher_quality": dict(min_doc_words=None, max_doc_words=None, min_avg_word_length=None,
                           max_avg_word_length=None, max_symbol_word_ratio=None, max_bullet_lines_ratio=None,
                           max_ellipsis_lines_ratio=None, min_alpha_words_ratio=None, min_stop_words=None),
    "gopher_repetition": {f.name: None for f in fields(GopherRepetitionConfig) if f.name != "enabled"},
    "c4": dict(remove_citations=False, filter_no_terminal_punct=False, min_words_per_line=None,
               max_word_length=None, filter_lorem_ipsum=False, filter_javascript=False,
               filter_curly_bracket=False, filter_policy=False, min_num_sentences=None),
    "fineweb": dict(line_punct_thr=None, short_line_thr=None, char_duplicates_ratio=None, new_line_ratio=None),
    "code": dict(max_line_length=None, max_mean_line_length=None, min_alphanum_fraction=None,
                 autogenerated_markers=()),
}
_ONE_CHECK = {
    "gopher_quality": [dict(min_doc_words=3), dict(max_doc_words=40), dict(min_avg_word_length=3.5),
                       dict(max_avg_word_length=4), dict(max_symbol_word_ratio=0.05), dict(max_symbol_word_ratio=0),
                       dict(max_bullet_lines_ratio=0.3), dict(max_ellipsis_lines_ratio=0.1),
                       dict(min_alpha_words_ratio=0.9), dict(min_stop_words=1),
                       dict(min_stop_words=3, stop_words=("the", "of", "…", "e.g", "the"))],
    "gopher_repetition": [{k: v} for k in _OFF["gopher_repetition"] for v in (0.0, 0.05, 0.2)],
    "c4": [dict(min_num_sentences=1), dict(min_num_sentences=4), dict(remove_citations=True, min_num_sentences=3),
           dict(filter_no_terminal_punct=True, min_num_sentences=2), dict(min_words_per_line=3, min_num_sentences=2),
           dict(max_word_length=10, min_num_sentences=2), dict(filter_lorem_ipsum=True),
           dict(filter_javascript=True, min_num_sentences=3), dict(filter_curly_bracket=True),
           dict(filter_policy=True, min_num_sentences=3),
           dict(remove_citations=True, filter_no_terminal_punct=True, filter_curly_bracket=True)],
    "fineweb": [dict(line_punct_thr=0.5), dict(line_punct_thr=0.2, line_punct_exclude_zero=True),
                dict(short_line_thr=0.5, short_line_length=5), dict(char_duplicates_ratio=0.001),
                dict(char_duplicates_ratio=0.05), dict(new_line_ratio=0.1)],
    "code": [dict(max_line_length=40), dict(max_mean_line_length=20.0), dict(min_alphanum_fraction=0.6),
             dict(autogenerated_markers=("generated by", "ς", "İ", "edit\nimport"), autogenerated_scan_lines=2)],
}


def _configs() -> list[tuple[str, Any]]:
    out = [(name, config_cls()) for name, (config_cls, _) in FILTERS.items()]
    for name, variants in _ONE_CHECK.items():
        config_cls = FILTERS[name][0]
        out += [(name, config_cls(**{**_OFF[name], **v})) for v in variants]
    return out


def test_compiled_filters_decide_as_the_python_reference() -> None:
    """Every text's reason (or None) from each compiled filter, over one batch, equals the reference's."""
    texts = _texts()
    batch = pa.array(texts, type=pa.large_string())
    for name, config in _configs():
        compiled, python = FILTERS[name][1](config), REFERENCE_FILTERS[name](config)
        got = compiled.check_batch(batch, np.ones(len(texts), dtype=np.bool_), {})
        want = [python.check(t) for t in texts]
        wrong = [(i, texts[i][:60], g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not wrong, (config, wrong[:3])
        assert len(set(want)) > 1, config  # the texts tell its outcomes apart


def test_filter_stage_chain_decides_as_the_python_reference() -> None:
    """web.yaml's chain through FilterStage (batch kernels sharing their splits) drops what the reference chain
    drops, with the same reasons, text by text."""
    texts = _texts()
    batch = pa.RecordBatch.from_pylist(
        [{"id": str(i), "text": t, "domain": "web", "order": i} for i, t in enumerate(texts)], schema=DOC_SCHEMA)
    chain = [FILTERS[n][1](FILTERS[n][0]()) for n in ("gopher_quality", "gopher_repetition", "c4", "fineweb")]
    result = FilterStage({}, chain)(batch)
    got = dict(zip(result.dropped.column("order").to_pylist(), result.dropped.column("reason").to_pylist()))
    want = {}
    for i, text in enumerate(texts):
        for f in chain:
            if (detail := REFERENCE_FILTERS[f.name](f.config).check(text)) is not None:
                want[i] = f"{f.name}:{detail}"
                break
    assert got == want
    assert len(set(want.values())) >= 4
