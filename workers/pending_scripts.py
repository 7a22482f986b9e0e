"""The Lua scripts over a lane's pending entries that custody's ownership round trips run (workers/consumer.py
`keep` and `claim`)."""

from __future__ import annotations

__all__ = ["CLAIM", "KEEP"]

# Keepalive: restart the idle time of the messages this consumer still owns (XCLAIM JUSTID to itself:
# no delivery counted), and say which are no longer its own: pending for another consumer (it claimed
# them after this one stalled past the claim timeout; a plain XCLAIM with min-idle 0 would take them
# back), or pending for nobody with their entry gone (answered and deleted by another worker: fleet
# deletes every message it acknowledges). A message pending for nobody whose entry is still there lost
# its delivery in a Redis restart and will be given out again: it stays held, and is answered here.
# KEYS[1] = stream; ARGV = group, consumer, then the ids held.
KEEP = """
local keep, lost = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then keep[#keep + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
  elseif redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])[1] == nil then
    lost[#lost + 1] = ARGV[i]
  end
end
for i = 1, #keep, 1000 do
  local args = {KEYS[1], ARGV[1], ARGV[2], 0}
  for j = i, math.min(i + 999, #keep) do args[#args + 1] = keep[j] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return lost
"""

# Claim: XAUTOCLAIM from the caller's cursor, with each claimed entry's exact delivery count (XAUTOCLAIM
# itself does not report it; poison detection depends on it). Atomic: nobody refreshes or claims between.
# KEYS[1] = stream; ARGV = group, consumer, min idle ms, cursor, count.
# Returns {next cursor, entries, delivery counts, ids deleted from the stream while pending}.
CLAIM = """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local counts = {}
for i, e in ipairs(r[2]) do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
  counts[i] = p[1] and p[1][4] or 1
end
return {r[1], r[2], counts, r[3] or {}}
"""
