"""Compressed input: the damage-aware codec layer under JSONL. Gzip members, zstd frames and bz2/xz/lzma
streams are decompressed a small step at a time into bounded pieces (`decompressed`); each member's check
(gzip's CRC-32 and length, a zstd frame's checksum) is verified, a gzip member or zstd frame that fails it
ends where its framing says, so the next one is still read, and `unusable_lines` finds, in a first pass
that keeps nothing but a newline count, the lines of the members that fail."""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

BLOCK = 1 << 20  # bytes per read of a JSONL file, and the most one decompression call hands over
_STEP = 1 << 16  # compressed bytes per decompression step: what damage can take with it


class _MaxLength:
    """A zlib/bz2/lzma decompressor whose output comes in pieces of at most BLOCK bytes (`max_length`),
    so a small compressed step of a highly repetitive text (gzip inflates up to ~1000x) is not
    decompressed whole at once."""

    damage = None  # bz2/lzma report a failed check by raising: the stream's end is then unknown

    def __init__(self, d: Any) -> None:
        self.d = d

    @property
    def eof(self) -> bool:
        return self.d.eof

    @property
    def unused_data(self) -> bytes:
        return self.d.unused_data

    def pieces(self, data: bytes) -> Iterator[bytes]:
        zlib_like = hasattr(self.d, "unconsumed_tail")
        while True:
            out = self.d.decompress(data, BLOCK)
            if out:
                yield out
            if self.d.eof:
                return
            if zlib_like:  # unconsumed input waits in unconsumed_tail; a full piece may leave output pending
                data = self.d.unconsumed_tail
                if not data and len(out) < BLOCK:
                    return
            else:  # bz2/lzma keep unconsumed input themselves and say when they need more
                data = b""
                if self.d.needs_input:
                    return


class _ZstdSlices:
    """A zstd decompressor fed _ZSTD_SLICE bytes at a time: zstandard's decompressobj has no output bound,
    and a zstd block of a repeated byte inflates ~32,000x, so a small input slice is the bound."""

    damage = None  # zstandard reports a failed checksum by raising; `frame_end` then finds the next frame

    def __init__(self) -> None:
        import zstandard

        self.d = zstandard.ZstdDecompressor().decompressobj()
        self.unused_data = b""

    @staticmethod
    def frame_end(raw: Any, start: int) -> int | None:
        """Where the zstd frame that begins at compressed offset `start` ends, read from its block headers
        (RFC 8878) without decoding it; None when its framing is damaged too or the file cannot seek."""
        import zstandard

        try:
            raw.seek(start)
            head = raw.read(18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 8 and magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size follows
                end = start + 8 + int.from_bytes(head[4:8], "little")
            elif len(head) >= 6 and magic == 0xFD2FB528:
                at = start + zstandard.frame_header_size(head)
                while True:
                    raw.seek(at)
                    block = raw.read(3)
                    if len(block) < 3:
                        return None
                    word = int.from_bytes(block, "little")
                    kind, size = (word >> 1) & 3, word >> 3
                    if kind == 3:  # reserved block type
                        return None
                    at += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
                    if word & 1:  # the last block
                        break
                end = at + (4 if head[4] & 0x04 else 0)  # the content checksum
            else:
                return None
            raw.seek(end - 1)
            if len(raw.read(1)) != 1:  # the frame runs past the end of the file: not a frame end
                return None
            return end
        except (OSError, ValueError, zstandard.ZstdError):
            return None

    @property
    def eof(self) -> bool:
        return self.d.eof

    def pieces(self, data: bytes) -> Iterator[bytes]:
        for at in range(0, len(data), _ZSTD_SLICE):
            if out := self.d.decompress(data[at : at + _ZSTD_SLICE]):
                yield out
            if self.d.eof:
                self.unused_data = self.d.unused_data + data[at + _ZSTD_SLICE :]
                return


_ZSTD_SLICE = 1 << 10  # compressed bytes per zstd call: at most ~32 MiB of output even for a run of one byte


class _BadStream(ValueError):
    """Compressed data that is not what its format says (a gzip header that is not one)."""


_GZIP_HEAD_MAX = 1 << 20  # a longer gzip header (a file name, a comment, extra fields) is not a header


def _gzip_header_size(head: bytes) -> int | None:
    """The size of the gzip member header (RFC 1952) that `head` starts with; None while more bytes are needed."""
    if head[:3] != b"\x1f\x8b\x08"[: len(head[:3])]:
        raise _BadStream(f"not a gzip member (it starts with {head[:3].hex()}, not 1f8b08)")
    if len(head) < 10:
        return None
    flags, at = head[3], 10
    if flags & 0xE0:
        raise _BadStream(f"not a gzip member (reserved header flags {flags:#04x})")
    if flags & 0x04:  # FEXTRA: a length, then that many bytes
        if len(head) < at + 2:
            return None
        at += 2 + int.from_bytes(head[at : at + 2], "little")
    for flag in (0x08, 0x10):  # FNAME, FCOMMENT: zero-terminated
        if flags & flag:
            end = head.find(b"\x00", at)
            if end < 0:
                return None
            at = end + 1
    if flags & 0x02:  # FHCRC: the low 16 bits of the CRC-32 of the header before it
        if len(head) < at + 2:
            return None
        if int.from_bytes(head[at : at + 2], "little") != zlib.crc32(head[:at]) & 0xFFFF:
            raise _BadStream("the gzip member's header fails its CRC")
        at += 2
    return at if len(head) >= at else None


class _GzipMember:
    """One gzip member (RFC 1952), its header parsed and its CRC-32 and length checked here, its deflate
    data inflated raw in bounded pieces (`_MaxLength`). zlib's own gzip mode (wbits=31) reports a failed
    check as an error with no say in where the member ended; here a member that fails its check ends at
    its trailer like any other (`damage` says why), so the members after it are still read. Zero bytes
    where a member would start are padding, skipped as gzip and Python's gzip module do."""

    def __init__(self) -> None:
        self.head = b""  # header bytes gathered until the header is complete
        self.body: _MaxLength | None = None  # raw deflate, once the header is parsed
        self.crc = self.size = 0  # of the decoded bytes
        self.trailer = b""
        self.eof = False
        self.unused_data = b""
        self.damage: str | None = None

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if self.body is None:
            if not self.head:
                data = data.lstrip(b"\x00")
                if not data:  # padding only: no member here
                    self.eof = True
                    return
            self.head += data
            size = _gzip_header_size(self.head[:_GZIP_HEAD_MAX])
            if size is None:
                if len(self.head) >= _GZIP_HEAD_MAX:
                    raise _BadStream(f"not a gzip member (no end of its header in {_GZIP_HEAD_MAX} bytes)")
                return
            data, self.head = self.head[size:], b""
            self.body = _MaxLength(zlib.decompressobj(wbits=-15))
        if not self.body.eof:
            for piece in self.body.pieces(data):
                self.crc = zlib.crc32(piece, self.crc)
                self.size += len(piece)
                yield piece
            if not self.body.eof:
                return
            data = self.body.unused_data
        self.trailer += data
        if len(self.trailer) >= 8:
            crc, size = int.from_bytes(self.trailer[:4], "little"), int.from_bytes(self.trailer[4:8], "little")
            self.unused_data, self.eof = self.trailer[8:], True
            if (crc, size) != (self.crc, self.size & 0xFFFFFFFF):
                self.damage = (f"its data has CRC-32 {self.crc:08x} and length {self.size & 0xFFFFFFFF}, "
                               f"its trailer says {crc:08x} and {size}")


def decompressors() -> dict[str, Callable[[], Any]]:
    return {
        ".gz": _GzipMember,
        ".bz2": lambda: _MaxLength(bz2.BZ2Decompressor()),
        ".xz": lambda: _MaxLength(lzma.LZMADecompressor()),
        ".lzma": lambda: _MaxLength(lzma.LZMADecompressor()),
        ".zst": _ZstdSlices,
    }


# What a member is called in a format, for the quarantine's details.
MEMBER_NAMES = {".gz": "gzip member", ".zst": "zstd frame", ".bz2": "bz2 stream", ".xz": "xz stream",
                 ".lzma": "lzma stream"}


def decompressed(
    raw: Any, make: Callable[[], Any], on_end: Callable[[str | None, bool], None] | None = None
) -> Iterator[bytes]:
    """Decompressed blocks of a stream of one or more members/frames, a small compressed step at a
    time, so that when the stream turns out damaged every block before the damage has been handed
    over (gzip.GzipFile.read drops what it decoded in the failing call), and in bounded pieces, so a
    bomb-like step does not land in memory whole. A stream cut inside a member raises EOFError:
    zstandard's own stream reader would end silently there.

    Each member that ends is reported to `on_end(damage, cut)`: why it failed its check (None: intact),
    and whether part of its data never came out. A gzip member that fails its CRC-32 or length ends at
    its trailer (all of it came out); a zstd frame that fails ends where its block headers say (what
    zstandard decoded in the failing call, and after, never comes out): reading goes on with the next
    member. Damage whose end cannot be told (a corrupt deflate, bz2 or xz stream, a zstd frame with
    damaged block headers) raises.

    After a member that fails its check, the text starts a fresh line: a '\n' is handed over (before
    `on_end`, so it counts as the failed member's) when its text, or the text before it when it was cut
    with nothing out, does not end in one. Its last line is cut off or garbled, and without the break the
    next member's first line, intact, would be glued to it and lost with it. (Where members were cut
    mid-line, the next member's first line is the tail of a damaged line: read on its own, it fails as
    a line of its own would.)"""
    member = None
    start = offset = 0  # compressed offsets: the current member's first byte; the end of what was read
    newline_last = True  # whether the text so far ends a line
    decoded = False  # whether the current member's text is not empty
    while chunk := raw.read(_STEP):
        offset += len(chunk)
        while chunk:
            if member is None or member.eof:
                member, start, decoded = make(), offset - len(chunk), False
            try:
                for piece in member.pieces(chunk):
                    newline_last, decoded = piece.endswith(b"\n"), True
                    yield piece
            except Exception as exc:
                end = (member.frame_end(raw, start)
                       if isinstance(member, _ZstdSlices) and is_decompression_error(exc) else None)
                if end is None:
                    raise
                raw.seek(end)  # the frame's output so far was handed over: `on_end` lets a caller drop it
                offset, member = end, None
                if not newline_last:  # the line it broke off in ends with it: the next frame starts a fresh one
                    newline_last = True
                    yield b"\n"
                if on_end is not None:
                    on_end(f"{type(exc).__name__}: {exc}", True)
                break
            chunk = member.unused_data if member.eof else b""
            if member.eof and member.damage is not None and decoded and not newline_last:
                newline_last = True  # (an empty member that fails holds no line: it breaks none)
                yield b"\n"
            if member.eof and on_end is not None:
                on_end(member.damage, False)
    if member is not None and not member.eof:
        raise EOFError("the file ends inside a compressed stream (truncated)")


@dataclass(frozen=True)
class BadMember:
    """A compressed member that failed its check: the lines holding its decoded bytes, and whether part of
    it never came out (`cut`: one more quarantined record stands for that part, whose lines are unknown)."""

    first: int
    last: int  # first - 1 when none of its bytes came out
    why: str
    cut: bool


def unusable_lines(path: str, make: Callable[[], Any], name: str) -> list[BadMember]:
    """The first pass over a compressed JSONL file: decompress it all, keeping nothing but a count of
    newlines, and return the members (`name`s) that fail their check, in order, so that the second
    pass quarantines their lines instead of parsing them.

    Why a first pass: a member's check (gzip's CRC-32 at its end, a zstd frame's checksum) comes after
    all of its data, and one member is commonly the whole file (`gzip file.jsonl`: 10 GB in one member),
    so neither holding a member's lines until its check nor spooling it to disk is bounded. Counting
    newlines keeps memory at one decompressed piece; the cost is decompressing the file twice (and, for
    a remote file, reading it twice). A line any of whose bytes came from a failed member counts as
    that member's, and so does the line a cut member's lost part would have gone on with (`decompressed`
    ends it). A file cut short keeps the lines that fully decoded: it has no check to fail."""
    bad: list[BadMember] = []
    lines = 0  # newlines decoded so far
    first = 1  # the line holding the current member's first byte
    size = 0  # bytes decoded from the current member
    newline_last = True  # whether the last byte decoded was a newline

    def ended(damage: str | None, cut: bool) -> None:
        nonlocal first, size
        if damage is not None and (size or cut):  # (an empty member that fails holds no record)
            last = first - 1 if not size else lines if newline_last else lines + 1
            where = (f"holding lines {first}-{last}" if not cut else
                     f"from line {first} (only lines {first}-{last} came out of it)" if last >= first else
                     f"after line {first - 1} (nothing came out of it)")
            bad.append(BadMember(first, last, f"the {name} {where} fails its check ({damage})", cut))
        first, size = lines + 1, 0

    with fsspec.open(path, "rb") as raw:
        try:
            for piece in decompressed(raw, make, ended):
                lines += piece.count(b"\n")
                size += len(piece)
                newline_last = piece.endswith(b"\n")
        except Exception as exc:
            if not is_decompression_error(exc):
                raise
            if not isinstance(exc, EOFError) and lines >= first:  # the complete lines of the member it stopped in
                bad.append(BadMember(first, lines, f"the {name} holding lines {first}-{lines} cannot be decompressed "
                                                    f"past line {lines} ({type(exc).__name__}: {exc})", False))
    return bad


def is_decompression_error(exc: BaseException) -> bool:
    """A corrupt or truncated compressed stream (not an I/O failure, which carries an errno)."""
    import zstandard

    if isinstance(exc, (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, _BadStream)):
        return True
    return isinstance(exc, OSError) and exc.errno is None  # gzip.BadGzipFile, bz2 "Invalid data stream"
