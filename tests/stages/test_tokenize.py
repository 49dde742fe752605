import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from datapipe.configbase import ConfigError
from datapipe.schema import DOC_SCHEMA
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
