"""HTTP body compression as Triton does it: Content-Encoding of a request (gzip/deflate, inflated under
a byte limit) and the response's encoding chosen from Accept-Encoding. Pure: stdlib only."""

from __future__ import annotations

import gzip
import zlib

from fleet.errors import InvalidInput

__all__ = ["compress", "decompress", "response_encoding"]


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """The body as sent before `encoding`; at most `limit` bytes, so a small compressed body cannot
    expand into gigabytes in this process (a "zip bomb")."""
    if not encoding or encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidInput(f"unsupported Content-Encoding '{encoding}'")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit)
        if inflater.unconsumed_tail:
            raise InvalidInput(f"the decompressed request body exceeds the limit of {limit} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise InvalidInput(f"failed to decompress request body: it is not a valid {encoding} stream "
                           f"(Content-Encoding: {encoding})") from exc
    if not inflater.eof:
        raise InvalidInput(f"failed to decompress request body ({encoding}): truncated stream")
    return out


def response_encoding(accept_encoding: str | None) -> str | None:
    """The compression to answer with, from Accept-Encoding: Triton picks the best q-value among
    identity, gzip and deflate. None = identity (also when nothing acceptable is offered)."""
    if not accept_encoding:
        return None
    best, best_q = None, 0.0
    for item in accept_encoding.split(","):
        token, _, params = item.strip().partition(";")
        q = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                q = float(params[2:])
            except ValueError:
                continue
        token = token.strip().lower()
        if token in ("gzip", "deflate", "identity") and q > best_q:
            best, best_q = token, q
    return None if best == "identity" else best


def compress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        # mtime 0: the same body compresses to the same bytes whenever it is sent (as zlib's own gzip
        # header, which the gRPC path writes); the time would only tell when a response was made.
        return gzip.compress(body, compresslevel=6, mtime=0)
    return zlib.compress(body)  # "deflate" means the zlib format, as Triton and tritonclient use it
