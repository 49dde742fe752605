"""The compiled GPT-2 split and table of pieces (`stages.fast_bpe_kernels`) against tiktoken's own `encode_ordinary`."""

import numpy as np
import orjson
import pyarrow as pa
import pytest

from helpers import ASSETS
from stages.fast_bpe import GPT2_PATTERN, compile_bpe, tokenizers_classes
from stages.fast_bpe_kernels import LETTER, NUMBER, OTHER, SPACE, PieceEncoder, tiktoken_classes
from stages.tokenize import TokenizerConfig, TokenizerTrainConfig, train_tokenizer

DOCS = [orjson.loads(line)["text"] for line in (ASSETS / "multilingual_sample.jsonl").read_bytes().splitlines()]
EDGES = [
    "", " ", "\n", "  ", " \n ", "a", "'", "'s", "''s", " 's", "'S 'T 're 've 'll 'd 'm 'x '", "it's they'll've",
    "x\x00y\x00\x00 \x00", "\t\t\n\n\n    \r\n  end  ", "word   ", "   word", "a\u00a0b\u3000\u3000c\u2003 d",
    "\u2028\u2029\x85\x1c\x1d\x1e\x1f\x0b\x0c", "e\u0301 \u0915\u094d\u0937 مرحبا ١٢٣ ١٢ ١２ Ⅻ ²³ ½", "👩‍👩‍👧 😀😀 !!??..",
    "\U00031350\U0002EBF0\U0002B739 \U0001FAE8 \U00011F00",  # assigned after Python 3.11's Unicode tables
    "<|endoftext|> <s> </s>", "ab" * 50_000, " " * 70_000 + "x", "x" + "\n" * 5_000, "1" * 9_999,
]
# Characters the pattern treats differently: its literals, every class, the white space tiktoken knows.
POOL = list("'strevlmdS aZ9!.,\t\n\r\x00") + ["\u00a0", "\u3000", "\u2028", "\x85", "\x1c", "é", "\u0301", "中",
                                                 "😀", "٣", "Ⅻ", "²", "\U00031350", "ß", "\ufeff", "\u200d"]


def _fuzz(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(POOL, size=rng.integers(0, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def fast():
    tok = train_tokenizer(DOCS, TokenizerConfig(bos_token="<s>", train=TokenizerTrainConfig(vocab_size=2000))).to_str()
    return compile_bpe(tok).encoder()


def _reference(fast, texts, head=-1, tail=-1):
    lists = [[head] * (head >= 0) + fast.encode(t) + [tail] * (tail >= 0) for t in texts]
    return [i for ids in lists for i in ids], [len(ids) for ids in lists]


def _check(fast, encoder, texts, head=-1, tail=-1, array=None):
    flat, lengths = encoder.encode(pa.array(texts, pa.large_string()) if array is None else array, head, tail)
    want_flat, want_lengths = _reference(fast, texts, head, tail)
    assert lengths.tolist() == want_lengths
    assert flat.dtype == np.uint32 and flat.tolist() == want_flat


def test_ids_are_tiktokens_on_every_language_edge_cases_and_fuzzed_text(fast):
    encoder = PieceEncoder(fast._encoding)
    _check(fast, encoder, DOCS + EDGES, head=7, tail=3)
    for seed in range(3):
        texts = _fuzz(1500, seed)
        for i in range(0, len(texts), 100):
            _check(fast, encoder, texts[i : i + 100])
    # not vacuously: the table holds pieces, and the merges are used
    assert encoder.count > 1000
    assert len(encoder.encode(pa.array(DOCS))[0]) < sum(len(t.encode()) for t in DOCS) * 0.8


def test_the_pieces_are_the_patterns_matches(fast):
    # The split itself, not only the ids: a wrong cut between two pieces whose bytes no token joins leaves the ids
    # unchanged. `regex` (tiktoken's own dependency, what its pure-Python path splits with) gives the matches.
    import regex

    pattern = regex.compile(GPT2_PATTERN)
    encoder = PieceEncoder(fast._encoding)
    texts = DOCS + EDGES + _fuzz(3000, 7)
    got = encoder.split(pa.array(texts, pa.large_string()))
    for text, pieces in zip(texts, got):
        assert pieces == [m.encode() for m in pattern.findall(text)], text


def test_a_table_that_overflows_is_emptied_and_grown_without_changing_ids(fast, monkeypatch):
    monkeypatch.setattr(PieceEncoder, "MAX_ENTRIES", 40)
    monkeypatch.setattr(PieceEncoder, "MAX_BYTES", 2_000)
    monkeypatch.setattr(PieceEncoder, "CHUNK_BYTES", 3_000)  # many chunks a batch, some documents larger than one
    encoder = PieceEncoder(fast._encoding)
    cleared = []
    clear = encoder.clear
    monkeypatch.setattr(encoder, "clear", lambda: (cleared.append(1), clear()))
    _check(fast, encoder, DOCS + EDGES, head=1, tail=2)
    _check(fast, encoder, DOCS[:5])
    assert len(cleared) > 3


def test_plain_and_sliced_arrays_and_nulls(fast):
    encoder = PieceEncoder(fast._encoding)
    texts = DOCS[:6]
    array = pa.array(["unused", *texts, "unused"], pa.string()).slice(1, len(texts))
    _check(fast, encoder, texts, array=array)
    flat, lengths = encoder.encode(pa.array(["a b", None, ""], pa.string()), 5, -1)
    assert lengths.tolist() == [1 + len(fast.encode("a b")), 1, 1] and flat.tolist()[-2:] == [5, 5]
    # a null whose offsets span bytes (Arrow allows it) is still an empty document
    spanning = pa.Array.from_buffers(pa.string(), 2, [pa.py_buffer(np.packbits([1, 0], bitorder="little")),
                                                      pa.py_buffer(np.array([0, 3, 6], np.int32)), pa.py_buffer(b"abcxyz")])
    assert encoder.encode(spanning, -1, 9)[1].tolist() == [len(fast.encode("abc")) + 1, 1]
    with pytest.raises(TypeError, match="string array"):
        encoder.encode(pa.array([b"x"], pa.binary()))


@pytest.mark.parametrize("data", [b"\xff", b"a\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xe4\xb8", b"\xf4\x90\x80\x80"])
def test_bytes_that_are_not_utf8_are_refused_and_leave_no_class_half_asked(fast, data):
    encoder = PieceEncoder(fast._encoding)
    text = "中文".encode() + data
    array = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, len(text)], np.int32)),
                                                   pa.py_buffer(text)])
    with pytest.raises(ValueError, match="not valid UTF-8"):
        encoder.encode(array)
    _check(fast, encoder, ["中文 text"])  # 中 and 文 were marked while scanning: asked again, not stuck


def test_a_failure_while_encoding_new_pieces_leaves_no_entry_without_ids(fast, monkeypatch):
    encoder = PieceEncoder(fast._encoding)
    real = encoder._encode_piece
    calls = []

    def failing(piece):
        calls.append(piece)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return real(piece)

    monkeypatch.setattr(encoder, "_encode_piece", failing)
    with pytest.raises(KeyboardInterrupt):
        encoder.encode(pa.array(DOCS[:3]))
    assert encoder.count == 0
    _check(fast, encoder, DOCS[:3])


def test_classes_are_tiktokens_and_agree_with_tokenizers_on_a_sample_of_code_points():
    points = [0x20, 0x27, 0x41, 0x5F, 0x31, 0x09, 0xA0, 0x3000, 0x0661, 0x2160, 0x00B2, 0x0301, 0x4E2D, 0x31350, 0xD800]
    classes = tiktoken_classes(points, GPT2_PATTERN)
    assert classes.tolist() == [SPACE, OTHER, LETTER, OTHER, NUMBER, SPACE, SPACE, SPACE, NUMBER, NUMBER, NUMBER,
                                OTHER, LETTER, LETTER, OTHER]
    assert tokenizers_classes(points[:-2]).tolist() == classes[:-2].tolist()
