"""A bulk job's requests and replies, written to their streams but kept out of Redis's AOF and replicas.

Both are recomputable: a job's rows are in its input file, and a request whose entry and reply are gone
is sent again, by the runner at its reply timeout or by the run that resumes the job (fleet/jobs/feed.py).
What a job cannot recompute (its record, progress and errors: fleet/jobs/records.py) stays logged. Logged,
each 64-row `mlp` request and its reply put ~130 KiB in the AOF, ~600 MB for a 300k-row job, which Valkey
writes out while the job computes: the offline scenario ran at 0.87-0.90x of direct compute with them
logged and 0.90-0.94x without (bench/RESULTS.md, stop 48).

`redis.set_repl(redis.REPL_NONE)` keeps the effects of the script's commands after it out of the AOF
and the replication stream (effects replication, Redis 3.2+ and Valkey). A Redis restart (or a
failover) therefore loses the job's requests and replies in flight; the job loses nothing.

A lane also carries online requests and its workers' consumer group, whose position (the last delivered
id, logged when a worker reads) may be past an unlogged entry. So that a replayed lane never restarts its
ids below that position (a new request could then be skipped by the group), the lane's own last id is
logged with each request (XSETID), and a lane the request creates is created logged first. A job's results
stream has one reader, the runner, which reads by id and resends what it misses: its ids need no log.
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

# Lua's unpack takes a few thousand values at most: an XADD of more replies than this is logged instead.
MAX_UNLOGGED_REPLIES = 1000
