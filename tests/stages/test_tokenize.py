import json
import logging

import orjson
import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from datapipe.core.config import ConfigError, from_dict
from datapipe.core.schema import DOC_SCHEMA
from helpers import ASSETS
from stages.tokenize import TokenizeStage, TokenizerConfig, TokenizerTrainConfig, describe, train_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.", "Grüße, 世界! ½"] * 30


def batch(texts):
    return pa.RecordBatch.from_pylist(
        [{"id": str(i), "domain": "d", "text": t, "order": i} for i, t in enumerate(texts)], schema=DOC_SCHEMA
    )


@pytest.fixture(scope="module")
def tok_json():
    cfg = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    return train_tokenizer(TEXTS, cfg).to_str()


def test_ids_equal_tokenizers_plus_eos_and_round_trip(tok_json):
    stage = TokenizeStage(tok_json, TokenizerConfig(batch_size=7))
    out = stage(batch(TEXTS[:5]))
    ref = Tokenizer.from_str(tok_json)
    eos = ref.token_to_id("<|endoftext|>")
    assert out.schema.field("tokens").type == pa.list_(pa.uint16())
    for text, ids, n in zip(TEXTS[:5], out.column("tokens").to_pylist(), out.column("num_tokens").to_pylist()):
        assert ids == ref.encode(text, add_special_tokens=False).ids + [eos]
        assert n == len(ids)
        assert ref.decode(ids[:-1]) == text  # byte-level BPE is lossless


def test_bos_is_prepended_when_configured():
    cfg = TokenizerConfig(bos_token="<s>", train=TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    tok = train_tokenizer(TEXTS, cfg).to_str()
    ids = TokenizeStage(tok, cfg)(batch(["hello"])).column("tokens").to_pylist()[0]
    t = Tokenizer.from_str(tok)
    assert ids[0] == t.token_to_id("<s>") and ids[-1] == t.token_to_id("<|endoftext|>")


def test_eos_missing_from_the_vocabulary_is_a_config_error(tok_json):
    with pytest.raises(ConfigError, match="eos_token '</s>' is not in the vocabulary"):
        TokenizeStage(tok_json, TokenizerConfig(eos_token="</s>"))


def test_uint32_when_the_vocabulary_needs_it(tok_json):
    info = describe(tok_json, "t.json", TokenizerConfig())
    assert info.dtype == "uint16" and info.vocab_size <= 300 and len(info.sha256) == 64
    from stages.tokenize import token_dtype

    assert token_dtype(65536) == pa.uint16() and token_dtype(65537) == pa.uint32()


def test_training_is_deterministic():
    cfg = TokenizerConfig(train=TokenizerTrainConfig(vocab_size=300, min_frequency=1))
    assert train_tokenizer(TEXTS, cfg).to_str() == train_tokenizer(TEXTS, cfg).to_str()


# ---------------------------------------------------------------- the fast encoder

SAMPLE = [orjson.loads(line) for line in (ASSETS / "multilingual_sample.jsonl").read_bytes().splitlines()]
MIXED = [d["text"] for d in SAMPLE] + ["a <|endoftext|> b <s> c", "", "It's 42\t\t\n  "]


@pytest.fixture(scope="module")
def ml_json():
    cfg = TokenizerConfig(bos_token="<s>", train=TokenizerTrainConfig(vocab_size=1000))
    return train_tokenizer([d["text"] for d in SAMPLE], cfg).to_str()


def test_encoder_config_is_validated():
    assert TokenizerConfig().encoder == "auto"
    with pytest.raises(ConfigError, match=r"'tokenizer.encoder' must be one of \['auto', 'tokenizers', 'fast'\], got 'tiktoken'"):
        from_dict(TokenizerConfig, {"encoder": "tiktoken"}, "tokenizer")
    with pytest.raises(ConfigError, match="encoder must be one of"):
        TokenizerConfig(encoder="rust")
    with pytest.raises(ConfigError, match="verify_bytes must be >= 0"):
        TokenizerConfig(verify_bytes=-1)


def test_every_encoder_writes_the_same_bits(ml_json):
    out = {}
    for encoder in ("tokenizers", "fast", "auto"):
        stage = TokenizeStage(ml_json, TokenizerConfig(bos_token="<s>", encoder=encoder, batch_size=7))
        assert stage.encoder == ("tokenizers" if encoder == "tokenizers" else "fast")
        out[encoder] = stage(batch(MIXED))
    assert out["tokenizers"].equals(out["fast"]) and out["tokenizers"].equals(out["auto"])
    ref = Tokenizer.from_str(ml_json)
    ref.encode_special_tokens = True
    bos, eos = ref.token_to_id("<s>"), ref.token_to_id("<|endoftext|>")
    for text, ids in zip(MIXED, out["fast"].column("tokens").to_pylist()):
        assert ids == [bos] + ref.encode(text, add_special_tokens=False).ids + [eos]


def test_special_token_text_never_becomes_a_special_id(ml_json):
    text = "before <|endoftext|> middle <s> after"
    for encoder in ("tokenizers", "fast"):
        ids = TokenizeStage(ml_json, TokenizerConfig(encoder=encoder))(batch([text])).column("tokens").to_pylist()[0]
        stage_specials = [i for i, t in enumerate(ids) if t in (0, 1)]  # <|endoftext|> = 0, <s> = 1
        assert stage_specials == [len(ids) - 1], encoder


def test_a_tokenizer_that_is_not_provably_equivalent_uses_tokenizers_or_is_refused(ml_json, caplog):
    spec = json.loads(ml_json)
    spec["normalizer"] = {"type": "NFKC"}
    tok = json.dumps(spec)
    with caplog.at_level(logging.WARNING, logger="stages.tokenize"):
        stage = TokenizeStage(tok, TokenizerConfig(), where="t.json")
    assert stage.encoder == "tokenizers" and "normalizer" in stage.why
    assert "t.json: encoding with tokenizers (slower)" in caplog.text and "normalizer" in caplog.text
    with pytest.raises(ConfigError, match="tokenizer.encoder is 'fast' but t.json cannot be compiled.*normalizer"):
        TokenizeStage(tok, TokenizerConfig(encoder="fast"), where="t.json")


def test_a_proof_made_once_is_used_as_made(ml_json):
    """The tokenize phase proves the fast encoder once, in the driver, and hands the answer to every worker's stage:
    the stage encodes by that answer (a refusal means tokenizers) with the same ids, and proves nothing itself."""
    from stages.fast_bpe import try_compile

    reference = TokenizeStage(ml_json, TokenizerConfig(encoder="tokenizers"))(batch(MIXED))
    proven = TokenizeStage(ml_json, TokenizerConfig(), compiled=try_compile(ml_json))
    assert proven.encoder == "fast" and proven(batch(MIXED)).equals(reference)
    refused = TokenizeStage(ml_json, TokenizerConfig(), compiled=(None, "a reason the driver found"))
    assert refused.encoder == "tokenizers" and refused.why.endswith("a reason the driver found")
    assert refused(batch(MIXED)).equals(reference)


class _Corrupt:
    """A fast encoder that gets one document wrong: what a regex-table difference would look like."""

    def __init__(self, inner, bad_text):
        self.inner, self.bad_text = inner, bad_text

    def encode_batch(self, texts):
        return [ids[:-1] + [ids[-1] ^ 1] if t == self.bad_text else ids for t, ids in zip(texts, self.inner.encode_batch(texts))]

    def encode_array(self, text, head=-1, tail=-1):
        lists = [[head] * (head >= 0) + ids + [tail] * (tail >= 0) for ids in self.encode_batch(text.to_pylist())]
        return np.array([i for ids in lists for i in ids], np.uint32), np.array([len(ids) for ids in lists], np.int64)


def test_a_sample_mismatch_names_the_document_and_falls_back(ml_json, caplog):
    reference = TokenizeStage(ml_json, TokenizerConfig(encoder="tokenizers"))(batch(MIXED))
    stage = TokenizeStage(ml_json, TokenizerConfig())
    stage.fast = _Corrupt(stage.fast, MIXED[3])
    with caplog.at_level(logging.WARNING, logger="stages.tokenize"):
        out = stage(batch(MIXED))
    assert out.equals(reference) and stage.encoder == "tokenizers"
    assert "document '3'" in caplog.text and "falling back to tokenizers" in caplog.text
    assert stage.mismatch.doc_id == "3"

    strict = TokenizeStage(ml_json, TokenizerConfig(encoder="fast"))
    strict.fast = _Corrupt(strict.fast, MIXED[3])
    with pytest.raises(RuntimeError, match="document '3'.*the run stops"):
        strict(batch(MIXED))
    with pytest.raises(RuntimeError, match="the run stops"):  # a retry of the block refuses too
        strict(batch(MIXED))


def test_the_sample_check_covers_the_first_verify_bytes_only(ml_json):
    # The budget is spent on the first documents; a difference after it is not seen (the proof in
    # stages/fast_bpe.py, not the sample, is what covers the rest).
    first = len(MIXED[0].encode())
    stage = TokenizeStage(ml_json, TokenizerConfig(verify_bytes=first))
    stage.fast = _Corrupt(stage.fast, MIXED[1])
    stage(batch(MIXED))
    assert stage.encoder == "fast" and stage.mismatch is None
    stage = TokenizeStage(ml_json, TokenizerConfig(verify_bytes=first + 1))
    stage.fast = _Corrupt(stage.fast, MIXED[1])
    stage(batch(MIXED[:1]))  # the budget carries over to the next batch
    assert stage.encoder == "fast"
    stage(batch(MIXED[1:]))
    assert stage.encoder == "tokenizers" and stage.mismatch.doc_id == "0"  # ids are per batch here


def test_the_dtype_and_vocab_size_come_from_the_largest_id_not_the_token_count(tok_json):
    """An EOS at id 70,000 in a 300-token vocabulary: uint32 ids and a vocabulary size of 70,001 (the
    token count, 300, would pick uint16 and crash on the EOS, and size a model's embedding too small)."""
    from helpers import with_eos_at

    sparse = with_eos_at(tok_json, 70_000)
    assert Tokenizer.from_str(sparse).get_vocab_size() <= 300
    info = describe(sparse, "t.json", TokenizerConfig())
    assert info.vocab_size == 70_001 and info.dtype == "uint32" and info.eos_id == 70_000
    out = TokenizeStage(sparse, TokenizerConfig())(batch(TEXTS[:3]))
    assert out.schema.field("tokens").type == pa.list_(pa.uint32())
    assert all(ids[-1] == 70_000 for ids in out.column("tokens").to_pylist())
