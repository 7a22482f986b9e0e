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

A lane also carries online requests and its workers' consumer group, whose position (the last delivered
id, logged when a worker reads) may be past an unlogged entry. So that a replayed lane never restarts its
ids below that position (a new request could then be skipped by the group), the lane's own last id is
logged with each request (XSETID), and a lane the request creates is created logged first. A job's results
stream has one reader, the runner, which reads by id and sends again what it misses: its ids need no log
(with a clock that went back across a restart, replies are lost until it catches up, and sent again).
"""

from __future__ import annotations

__all__ = ["JOB_REPLY_XADD", "JOB_REQUEST_XADD", "MAX_UNLOGGED_REPLIES"]

# KEYS[1] = the lane; ARGV[1] = the request's payload (field "d"). Returns the entry id, as XADD does.
JOB_REQUEST_XADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- An empty stream, logged: the XSETID below then replays onto a stream that exists.
  redis.call('XADD', KEYS[1], 'MAXLEN', '0', '*', 'd', '')
end
redis.set_repl(redis.REPL_NONE)
local id = redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])
redis.set_repl(redis.REPL_ALL)
redis.call('XSETID', KEYS[1], id)
return id
"""

# KEYS[1] = a job's results stream; ARGV = XADD's arguments after the key. Returns the entry id.
JOB_REPLY_XADD = """
redis.set_repl(redis.REPL_NONE)
return redis.call('XADD', KEYS[1], unpack(ARGV))
"""

# Lua's unpack takes fewer than 8,000 values (LUAI_MAXCSTACK), two a reply: well under it, an XADD of more
# replies than this (a batch of more than 1,000 requests to one job) is logged instead.
MAX_UNLOGGED_REPLIES = 1000
