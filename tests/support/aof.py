"""A stopped Valkey's AOF cut short, as a kill loses what the server had acknowledged but not yet written (with
`appendfsync everysec` while an fsync is slow) and as a failover to a lagging replica loses what it had not
received: always the last writes, in order."""

from __future__ import annotations

from pathlib import Path


def commands(buf: bytes) -> list[tuple[int, list[bytes]]]:
    """Each command of an AOF (RESP arrays of bulk strings, one after the other): (its offset, its argv)."""
    out: list[tuple[int, list[bytes]]] = []
    i = 0
    while i < len(buf):
        start = i
        assert buf[i:i + 1] == b"*", f"not a command at byte {i}: {buf[i:i + 20]!r}"
        end = buf.index(b"\r\n", i)
        argc, i = int(buf[i + 1:end]), end + 2
        argv = []
        for _ in range(argc):
            end = buf.index(b"\r\n", i)
            size, i = int(buf[i + 1:end]), end + 2
            argv.append(buf[i:i + size])
            i += size + 2
        out.append((start, argv))
    return out


def cut_before_last(data_dir: Path, command: bytes, key: str, n: int) -> list[list[bytes]]:
    """Truncate the AOF of the server whose `--dir` is `data_dir` (stopped) just before its `n`-th last
    `command key ...`; returns the commands cut, in order."""
    (incr,) = (data_dir / "appendonlydir").glob("*.incr.aof")
    buf = incr.read_bytes()
    parsed = commands(buf)
    hits = [k for k, (_, argv) in enumerate(parsed)
            if argv[0].upper() == command.upper() and len(argv) > 1 and argv[1] == key.encode()]
    assert len(hits) >= n, f"{len(hits)} {command!r} of {key} in the AOF, not {n}"
    first = hits[-n]
    incr.write_bytes(buf[:parsed[first][0]])
    return [argv for _, argv in parsed[first:]]
