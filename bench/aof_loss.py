"""Writes a killed Valkey had acknowledged and its AOF lost, by `appendfsync` policy, beside a busy disk.

    .venv/bin/python bench/aof_loss.py [--policies "everysec no"] [--rounds 10] [--seconds 3]

Each round starts a Valkey with the AOF on and the policy (alternated, in a fresh directory under a temporary
one) and adds 2 KB stream entries one at a time, counting each one it answered, until it reports a background
fsync of its AOF in progress (`aof_pending_bio_fsync`) and 20 more were answered, or for `--seconds` (`no` runs
no fsync). Then it kills the server with SIGKILL, starts it again on the same directory (replaying its AOF) and
counts the entries it kept. Meanwhile two processes keep the disk busy syncing: one writes 256 MiB and fsyncs
it, over and over; one writes 64 KiB blocks each followed by an fsync. With `everysec`, Valkey postpones its
AOF write (up to 2 s) while its previous background fsync is still running, yet answers its clients; a kill in
that window loses writes it acknowledged. With `no` it writes before it answers, and only a host crash loses
them. fleet's embedded server and compose.yaml's run `no` (fleet/redis_server.py).

Bounded: rounds x policies kills, at most `--seconds` each plus the restarts. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.synchronize
import os
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleet.redis_server import start_server  # noqa: E402


def _busy_disk(directory: Path, stop: multiprocessing.synchronize.Event, block: int, blocks: int) -> None:
    """Write `blocks` blocks of `block` bytes and fsync, again and again (after each block if blocks is 1)."""
    chunk = b"\0" * block
    path = directory / f"busy-{block}"
    while not stop.is_set():
        with open(path, "wb") as f:
            for _ in range(blocks if blocks > 1 else 2000):
                f.write(chunk)
                if blocks == 1:
                    os.fsync(f.fileno())
                if stop.is_set():
                    break
            os.fsync(f.fileno())
    path.unlink(missing_ok=True)


def one_round(directory: Path, policy: str, seconds: float) -> tuple[int, int]:
    """(acknowledged, kept) for one kill."""
    server = start_server(directory, appendfsync=policy)
    try:
        client = redis.Redis.from_url(server.url)
        acknowledged, entry = 0, {"d": b"x" * 2000}
        started, fsyncing = time.monotonic(), 0
        # The kill comes once Valkey reports a background fsync of its AOF in progress (after 20 more writes, each
        # answered), or after `seconds` if it never does: `no` runs none.
        while fsyncing < 20 and time.monotonic() - started < seconds:
            client.xadd("q", entry)  # type: ignore[arg-type]
            acknowledged += 1
            if fsyncing:
                fsyncing += 1
            elif acknowledged % 16 == 0 and client.info("persistence")["aof_pending_bio_fsync"]:
                fsyncing = 1
        client.close()
        server.process.kill()  # SIGKILL
        server.process.wait()
        server.restart(startup_timeout_s=30)  # same port and directory: its AOF replayed
        client = redis.Redis.from_url(server.url)
        kept = int(client.xlen("q"))
        client.close()
        return acknowledged, kept
    finally:
        server.process.kill()
        server.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="everysec no")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    policies = args.policies.split()
    lost: dict[str, list[int]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory(prefix="aof-loss-") as tmp:
        stop = multiprocessing.Event()
        busy = [multiprocessing.Process(target=_busy_disk, args=(Path(tmp), stop, 1 << 20, 256), daemon=True),
                multiprocessing.Process(target=_busy_disk, args=(Path(tmp), stop, 64 << 10, 1), daemon=True)]
        for process in busy:
            process.start()
        try:
            for r in range(args.rounds):
                for policy in policies if r % 2 == 0 else policies[::-1]:
                    directory = Path(tmp) / f"{policy}-{r}"
                    directory.mkdir()
                    acknowledged, kept = one_round(directory, policy, args.seconds)
                    lost[policy].append(acknowledged - kept)
                    print(f"round {r} {policy:>8}: acknowledged {acknowledged:,}, kept {kept:,}, "
                          f"lost {acknowledged - kept:,}", flush=True)
        finally:
            stop.set()
            for process in busy:
                process.join()
    print("\n| appendfsync | kills | kills that lost acknowledged writes | writes lost |\n|---|---|---|---|")
    for policy, counts in lost.items():
        print(f"| {policy} | {len(counts)} | {sum(1 for n in counts if n)} | {sum(counts):,} |")


if __name__ == "__main__":
    main()
