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
