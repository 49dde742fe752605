import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from stages.normalize import NormalizeConfig, NormalizeStage


def batch(texts):
    return pa.RecordBatch.from_pylist(
        [{"id": str(i), "domain": "d", "text": t, "order": i} for i, t in enumerate(texts)], schema=DOC_SCHEMA
    )


def test_nfc_newlines_trailing_blanks_and_blank_runs():
    stage = NormalizeStage(NormalizeConfig())
    decomposed = "Cafe\u0301 au lait"  # e + combining acute accent
    out = stage(batch([decomposed, "a  \r\nb\t\r\n\r\n\r\n\r\n\r\nc\n\n", "\n\n  \n"]))
    assert out.kept.column("text").to_pylist() == ["Caf\u00e9 au lait", "a\nb\n\n\nc"]
    assert out.dropped.column("reason").to_pylist() == ["empty_after_normalize"]
    assert out.dropped.column("stage").to_pylist() == ["normalize"]


def test_each_rule_can_be_turned_off():
    stage = NormalizeStage(
        NormalizeConfig(unicode_form="none", strip_trailing_whitespace=False, max_blank_lines=-1, normalize_newlines=False)
    )
    text = "Cafe\u0301  \r\n\n\n\n\nx"
    assert stage(batch([text])).kept.column("text").to_pylist() == [text]


def test_nfkc_folds_compatibility_characters():
    stage = NormalizeStage(NormalizeConfig(unicode_form="NFKC"))
    assert stage(batch(["\ufb01le \u2460"])).kept.column("text").to_pylist() == ["file 1"]


def _one_document_at_a_time(text: str, c: NormalizeConfig) -> str:
    """The rules as a per-document Python function (the stage's former implementation): the column-wise
    stage must give the same text."""
    import re
    import unicodedata

    if c.normalize_newlines and "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if c.unicode_form != "none" and not text.isascii():
        text = unicodedata.normalize(c.unicode_form, text)
    if c.strip_trailing_whitespace:
        text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    if c.max_blank_lines >= 0:
        text = re.sub(r"\n{%d,}" % (c.max_blank_lines + 2), "\n" * (c.max_blank_lines + 1), text)
    return text.strip("\n")


def test_column_rules_equal_the_per_document_rules_on_real_and_awkward_text():
    import json
    from pathlib import Path

    slice_ = Path(__file__).parents[1] / "assets" / "corpus_slice.jsonl"
    texts = [json.loads(line)["text"] for line in slice_.read_text().splitlines() if line.strip()]
    texts += ["a \t\r\nb  \r c\n\n\n\n\n d \t", "x\u00a0 \n\ty", "e\u0301 \t\n\n\n\n\nz\r", "\n\n lead  ",
              "tab\t\t", "\r\r\r\r\r", "\u3000 \n\n\n\nend \u2003", "\ufb01 \r\n\r\n\r\n\r\n\u2460", "\x1c\n\n",
              "\u3000\u2003 \x1f\x85", "\u2029\u205f", "\u200b", ""]
    for config in (NormalizeConfig(), NormalizeConfig(unicode_form="NFKC", max_blank_lines=0),
                   NormalizeConfig(normalize_newlines=False, max_blank_lines=5)):
        expected = [_one_document_at_a_time(t, config) for t in texts]
        out = NormalizeStage(config)(batch(texts))
        kept = out.kept.column("text").to_pylist()
        assert kept == [t for t in expected if t.strip()]
        assert out.dropped.num_rows == sum(1 for t in expected if not t.strip())


def test_the_blank_pattern_knows_every_character_python_calls_whitespace():
    import sys

    from stages import normalize

    assert normalize._PYTHON_WHITESPACE == [c for c in range(sys.maxunicode + 1) if chr(c).isspace()]
