"""The Lua scripts a gateway's broker runs on a model's lane streams (fleet/broker.py): each decides and
acts in one atomic step on the server, in the same round trip as the commands around it."""

from __future__ import annotations

from fleet.keys import GROUP

__all__ = ["BOUNDED_XADD", "REJECT_UNREAD"]

# A bounded lane (max_queue_size): enqueue only while fewer than ARGV[1] requests wait for a worker, in
# the same round trip as the other XADDs. "Waiting" = entries not yet delivered to a worker (the stream
# length less the group's pending count): what a worker has read ahead or is executing is bounded by
# the worker itself, as Triton's queue size excludes executing requests. Returns nil when full.
BOUNDED_XADD = f"""
local waiting = redis.call('XLEN', KEYS[1])
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], '{GROUP}')
if ok then waiting = waiting - pending[1] end
if waiting >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], '*', 'd', ARGV[2])
"""


# REJECT for a request no worker has read: at its queue deadline, the gateway deletes it from its lane
# if it is still undelivered (its id is past the group's last-delivered id) and counts it as rejected in
# the model's statistics, atomically: a worker that read it first rejects (or runs) it instead. Without
# this, a request waiting in Redis behind a full worker would be answered only once a worker has room.
# KEYS[1] = lane stream, KEYS[2] = the model's stats hash (same hash tag); ARGV[1] = entry id, then
# field/delta pairs. Returns 1 if it was deleted (the caller answers the timeout), else 0.
REJECT_UNREAD = f"""
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local last = '0-0'
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return 0 end
for _, g in ipairs(groups) do
  local info = {{}}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == '{GROUP}' then last = info['last-delivered-id'] end
end
local ms, seq = parse(ARGV[1])
local lms, lseq = parse(last)
if ms < lms or (ms == lms and seq <= lseq) then return 0 end
if redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])[1] == nil then return 0 end
-- Counted first: under maxmemory HINCRBY may be refused, and then nothing has changed.
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('XDEL', KEYS[1], ARGV[1])
return 1
"""
