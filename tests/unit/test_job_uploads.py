"""Job uploads as they stream in (gateway/jobs/uploads.py): Content-Encoding and `.gz` names undone, in
bounded pieces, and the byte limit held as received and after inflation (zip bombs)."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable

import pytest

from fleet.errors import InvalidInput, TooLarge
from gateway.jobs.uploads import PIECE_BYTES, UploadDecoder

TEXT = b"".join(b'{"inputs": [{"name": "IN", "data": [%d]}]}\n' % i for i in range(5000))


def chunks(data: bytes, size: int = 7_919) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def decode(decoder: UploadDecoder, parts: Iterable[bytes]) -> bytes:
    out = []
    for part in parts:
        for piece in decoder.feed(part):
            assert len(piece) <= PIECE_BYTES
            out.append(piece)
    decoder.finish()
    return b"".join(out)


@pytest.mark.parametrize(("encoding", "compress"), [
    (None, lambda b: b), ("identity", lambda b: b), ("gzip", gzip.compress), ("x-gzip", gzip.compress),
    ("GZIP", gzip.compress), ("deflate", zlib.compress),
])
def test_content_encodings_are_undone(encoding: str | None, compress: object) -> None:
    assert callable(compress)
    decoder = UploadDecoder(10 * len(TEXT), encoding, None)
    assert decode(decoder, chunks(compress(TEXT))) == TEXT
    assert decoder.stored == len(TEXT)


def test_a_gz_name_and_concatenated_members_as_gzip_reads_them() -> None:
    body = gzip.compress(TEXT[:1000]) + gzip.compress(TEXT[1000:])  # `cat a.gz b.gz`, pigz
    assert decode(UploadDecoder(len(TEXT), None, "in.jsonl.gz"), chunks(body, 100)) == TEXT
    # both layers: a .jsonl.gz sent with Content-Encoding: gzip on top
    assert decode(UploadDecoder(len(TEXT), "gzip", "in.jsonl.gz"), chunks(gzip.compress(body))) == TEXT


def test_the_limit_holds_as_received_and_as_stored() -> None:
    assert decode(UploadDecoder(len(TEXT), None, None), chunks(TEXT)) == TEXT  # exactly the limit passes
    with pytest.raises(TooLarge, match=f"over the limit of {len(TEXT) - 1} bytes"):
        decode(UploadDecoder(len(TEXT) - 1, None, None), chunks(TEXT))
    with pytest.raises(TooLarge, match="once decompressed"):
        decode(UploadDecoder(len(TEXT) - 1, "gzip", None), chunks(gzip.compress(TEXT)))


@pytest.mark.parametrize(("encoding", "name"), [("gzip", None), (None, "bomb.jsonl.gz"), ("gzip", "bomb.jsonl.gz")])
def test_a_zip_bomb_stops_at_the_limit_without_inflating_it(encoding: str | None, name: str | None) -> None:
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # 64 MiB from ~64 KB
    if encoding and name:
        bomb = gzip.compress(bomb)
    decoder = UploadDecoder(4 << 20, encoding, name)
    produced = 0
    with pytest.raises(TooLarge):
        for piece in decoder.feed(bomb):
            produced += len(piece)
    assert produced <= 4 << 20  # never more than the limit handed out, one bounded piece at a time


def test_broken_or_truncated_streams_and_unknown_encodings_are_client_errors() -> None:
    with pytest.raises(InvalidInput, match=r"Content-Encoding: gzip\) is not valid gzip data"):
        decode(UploadDecoder(1 << 20, "gzip", None), [b"plain text, not gzip"])
    with pytest.raises(InvalidInput, match="'x.jsonl.gz' ends inside its gzip stream"):
        decode(UploadDecoder(1 << 20, None, "x.jsonl.gz"), [gzip.compress(TEXT)[:-10]])
    with pytest.raises(InvalidInput, match="data after the end of its deflate stream"):
        decode(UploadDecoder(1 << 20, "deflate", None), [zlib.compress(b"a") + b"junk"])
    with pytest.raises(InvalidInput, match="unsupported Content-Encoding 'br'"):
        UploadDecoder(1 << 20, "br", None)
