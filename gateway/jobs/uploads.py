"""Job uploads as they arrive: undo the body's Content-Encoding and a `.gz` name, and bound the bytes.

A JSONL or array job reads its input at byte offsets (to resume), which a compressed file cannot give,
so compressed uploads are stored decompressed: `Content-Encoding: gzip` (or `deflate`) on the request,
a name ending in `.gz`, or both (both layers are undone). Decompression streams in bounded pieces and
every layer's output counts against the upload limit, so a small "zip bomb" is refused (TooLarge) after
at most the limit's worth of work and disk, never inflated whole in memory. Pure: no HTTP, no files.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

from fleet.errors import InvalidInput, TooLarge

PIECE_BYTES = 1 << 20  # the most one decompression step produces at once
ENCODINGS = ("gzip", "x-gzip", "deflate")


class _Inflater:
    """One compression layer, streamed: gzip (any number of concatenated members, as gzip(1) reads them)
    or deflate (the zlib format, as HTTP means it)."""

    def __init__(self, fmt: str, what: str, limit: int) -> None:
        self._limit = limit
        self._produced = 0  # bounded too: a bomb inside a bomb must not run long before the last layer
        self._wbits = 16 + zlib.MAX_WBITS if fmt == "gzip" else zlib.MAX_WBITS
        self._fmt = fmt
        self._what = what  # for messages: "the request body (Content-Encoding: gzip)" or "'x.jsonl.gz'"
        self._z = zlib.decompressobj(self._wbits)
        self._started = False  # a member has begun: its end must arrive before the upload ends

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            self._started = True
            try:
                out = self._z.decompress(data, PIECE_BYTES)
            except zlib.error as exc:
                raise InvalidInput(f"{self._what} is not valid {self._fmt} data ({exc.args[0]})") from None
            if out:
                self._produced += len(out)
                if self._produced > self._limit:
                    raise TooLarge(_over(self._limit, "once decompressed"))
                yield out
            if self._z.eof:  # a member ended; gzip may go on with another one
                data = self._z.unused_data
                if data and self._fmt != "gzip":
                    raise InvalidInput(f"{self._what} has data after the end of its {self._fmt} stream")
                self._z = zlib.decompressobj(self._wbits)
                self._started = False
            else:
                data = self._z.unconsumed_tail

    def finish(self) -> None:
        if self._started:
            raise InvalidInput(f"{self._what} ends inside its {self._fmt} stream (truncated upload?)")


class UploadDecoder:
    """Bytes as received -> bytes to store, through the layers an upload was sent with.

    `feed(chunk)` yields the pieces to write; `finish()` checks that every compressed stream was complete.
    Raises TooLarge when the bytes received, or the bytes any layer produces, pass `limit`, and
    InvalidInput for an unknown Content-Encoding or data that does not decompress.
    """

    def __init__(self, limit: int, content_encoding: str | None, gzip_name: str | None) -> None:
        self.limit = limit
        self.received = 0
        self.stored = 0
        self._layers: list[_Inflater] = []
        encoding = (content_encoding or "").strip().lower()
        if encoding and encoding != "identity":
            if encoding not in ENCODINGS:
                raise InvalidInput(f"unsupported Content-Encoding '{content_encoding}' for an upload: send it "
                                   "as is, or with gzip or deflate")
            fmt = "deflate" if encoding == "deflate" else "gzip"
            self._layers.append(_Inflater(fmt, f"the upload (Content-Encoding: {encoding})", limit))
        if gzip_name is not None:
            self._layers.append(_Inflater("gzip", f"'{gzip_name}'", limit))

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        self.received += len(chunk)
        if self.received > self.limit:
            raise TooLarge(_over(self.limit, ""))
        pieces: Iterable[bytes] = (chunk,)
        for layer in self._layers:
            pieces = self._layer(layer, pieces)
        for piece in pieces:
            self.stored += len(piece)  # the last layer's bound is this one
            yield piece

    @staticmethod
    def _layer(layer: _Inflater, pieces: Iterable[bytes]) -> Iterator[bytes]:
        for piece in pieces:
            yield from layer.feed(piece)

    def finish(self) -> None:
        for layer in self._layers:
            layer.finish()


def _over(limit: int, how: str) -> str:
    return f"the upload is over the limit of {limit} bytes{' ' + how if how else ''} (FLEET_MAX_UPLOAD_BYTES)"
