"""A bulk job's requests and replies, written to their streams but not to Redis's AOF or replicas as they go.

Both are recomputable: a job's rows are in its input file, and a request whose entry and reply are gone
is sent again, by the runner at its reply timeout or by the run that resumes the job (fleet/jobs/feed.py).
What a job cannot recompute (its record, progress and errors: fleet/jobs/records.py) stays logged. Logged,
each 64-row `mlp` request and its reply put ~130 KiB in the AOF, ~600 MB for a 300k-row job, which Valkey
writes out while the job computes (bench/RESULTS.md, stops 47 and 48).

`redis.set_repl(redis.REPL_NONE)` keeps the effects of the script's commands after it out of the AOF and
the replication stream (effects replication: Redis 7 and Valkey, which fleet needs anyway). What is in
memory still reaches the disk and the replicas whole when an AOF rewrite or a replica's full sync copies
it: then a job's entries in flight go too, and their later deletions (logged) remove them again. A Redis
restart (or a failover) may therefore lose a job's requests and replies in flight; the job loses nothing.

Each stream's own last id is logged with every entry (XSETID), and a stream the entry creates is created
logged first, so a replayed or replicated stream never restarts its ids below what was read from it, even
on a clock that went back (a restart, or a failover to a primary whose clock is behind): XADD gives a new
entry an id past the stream's last one.
- A lane also carries online requests and its workers' consumer group, whose position (the last delivered
  id, logged when a worker reads) may be past an unlogged entry: a lane restarting below it would have a
  new request skipped by the group.
- A job's results stream has one reader, the runner, which reads by id from the last one it read: one
  restarting below it would hide the job's replies until the clock caught up. (The runner also reads a
  results stream from its start again when it finds it went back anyway, fleet/jobs/results.py: a replica
  that missed the last XSETIDs.)
"""

from __future__ import annotations

__all__ = ["MAX_UNLOGGED_REPLIES", "UNLOGGED_XADD"]

# KEYS[1] = the stream (a lane, or a job's results); ARGV = XADD's arguments after the key. Returns the
# entry id, as XADD does.
UNLOGGED_XADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- An empty stream, logged: the XSETID below then replays onto a stream that exists.
  redis.call('XADD', KEYS[1], 'MAXLEN', '0', '*', 'd', '')
end
redis.set_repl(redis.REPL_NONE)
local id = redis.call('XADD', KEYS[1], unpack(ARGV))
redis.set_repl(redis.REPL_ALL)
redis.call('XSETID', KEYS[1], id)
return id
"""

# Lua's unpack takes fewer than 8,000 values (LUAI_MAXCSTACK), two a reply: well under it, an XADD of more
# replies than this (a batch of more than 1,000 requests to one job) is logged instead.
MAX_UNLOGGED_REPLIES = 1000
