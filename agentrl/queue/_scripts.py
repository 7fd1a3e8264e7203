"""Lua scripts of the trajectory queue: each one is a single atomic step on the server.

Keys of a queue on stream S (all in one hash slot when S contains a ``{hash tag}``):

- ``S``            the stream; entry fields ``i`` (trajectory id), ``v`` (oldest weight version) and ``t`` (the
                   msgpack payload, inline: one copy on the server, read back by a plain XREADGROUP);
- ``S:versions``   hash  version -> number of unacknowledged entries of that version;
- ``S:ids``        hash  trajectory id -> its version for entries in the stream, set by ADMIT (makes ``put``
                   retries idempotent);
- ``S:dead``       dead-letter stream: fields ``id``, ``error``, ``consumer``, ``payload``.

No script ever receives or returns a payload on the hot path: moving a 50 KB string through Lua copies it twice
and cost 2x a plain XADD on Redis 7 (measured: ``benchmarks/queue_bench.py``). So ``put`` is two round trips:
ADMIT (small: trajectory ids and versions) picks the entries that fit and are not queued yet, marks them in
``S:ids`` and counts them in ``S:versions``, then one pipeline adds each with a plain XADD, and ``read`` is a
plain XREADGROUP. (The XADDs are not wrapped in MULTI/EXEC: with the append-only file on, Redis 6.2's EXEC cost
~20 us of server time per 47 KB entry, a third more than the XADD itself; nothing needs them atomic.)

ADMIT and ACK take their per-entry strings as a few arguments, each a msgpack array (:func:`packed`) that the script
reads with Redis's built-in ``cmsgpack``, not as one argument per string: redis-py's client spends ~0.35 us on each
argument (an ACK of 32 entries had 97), msgpack ~4 us on the whole list.

Invariant: every entry in ``S`` is marked in ``S:ids`` and counted in ``S:versions`` (ADMIT marks and counts
first, ACK forgets both). A marker without its entry (the producer died between ADMIT and its XADDs, or the
connection broke in between) is stale, and still counted: a ``put`` that meets it finds no entry, drops it and its
count (DROP_STALE), and admits the trajectory again. The stream holds exactly the unacknowledged entries, so
``XLEN S`` is the queue length used for backpressure.
"""

from collections.abc import Sequence

import msgpack


def packed(strings: Sequence[str | bytes]) -> bytes:
    """One script argument holding ``strings``: a msgpack array of raw strings (the old spec's types, the only ones
    Redis's ``cmsgpack.unpack`` reads: no bin or str8)."""
    return msgpack.packb(strings, use_bin_type=False)  # type: ignore[no-any-return]


# Removes entry `id` (already XACK-ed) from the stream and the side tables, reading its fields 'i' and 'v' from
# the entry (which copies its payload into Lua: only for entries whose fields the caller does not know, e.g.
# delivered before a consumer restarted). Returns its payload, or '' when it has none.
_FORGET = """
local function forget(id)
  local e = redis.call('XRANGE', KEYS[1], id, id)
  if not e[1] then return '' end
  local tid, ver, payload = false, false, ''
  local f = e[1][2]
  for j = 1, #f, 2 do
    if f[j] == 'i' then tid = f[j + 1] elseif f[j] == 'v' then ver = f[j + 1] elseif f[j] == 't' then payload = f[j + 1] end
  end
  if ver then
    if redis.call('HINCRBY', KEYS[2], ver, -1) <= 0 then redis.call('HDEL', KEYS[2], ver) end
  end
  if tid then redis.call('HDEL', KEYS[3], tid) end
  redis.call('XDEL', KEYS[1], id)
  return payload
end
"""

# KEYS: S, S:ids, S:versions.  ARGV: capacity, packed trajectory ids (distinct), packed versions (one per id).  The
# admission half of ``put``: one reply per leading id, stopping at the first one that does not fit under `capacity`
# unacknowledged entries:
#   ''  admitted: marked in S:ids and counted in S:versions; the caller adds it now (XADD);
#   '+' already queued (a retried put whose first try got in): the caller finds its entry id.
# Admission does not reserve: concurrent producers may together go over `capacity` by one chunk each.
ADMIT = """
local cap = tonumber(ARGV[1])
local tids, vers = cmsgpack.unpack(ARGV[2]), cmsgpack.unpack(ARGV[3])
local len = redis.call('XLEN', KEYS[1])
local out = {}
for i = 1, #tids do
  if len < cap then  -- room: mark it unless it is marked already (one HSETNX for both)
    if redis.call('HSETNX', KEYS[2], tids[i], vers[i]) == 1 then
      len = len + 1
      redis.call('HINCRBY', KEYS[3], vers[i], 1)
      out[#out + 1] = ''
    else
      out[#out + 1] = '+'
    end
  elseif redis.call('HEXISTS', KEYS[2], tids[i]) == 1 then
    out[#out + 1] = '+'
  else
    break
  end
end
return out
"""

# KEYS: S:ids, S:versions.  ARGV: trajectory ids whose markers are stale (no entry in the stream).  Drops each
# marker and the count ADMIT made for it.
DROP_STALE = """
for i = 1, #ARGV do
  local ver = redis.call('HGET', KEYS[1], ARGV[i])
  if ver then
    redis.call('HDEL', KEYS[1], ARGV[i])
    if redis.call('HINCRBY', KEYS[2], ver, -1) <= 0 then redis.call('HDEL', KEYS[2], ver) end
  end
end
return #ARGV
"""

# KEYS: S, S:versions, S:ids.  ARGV: group, packed entry ids, packed trajectory ids, packed versions (one each per
# entry id; '' when the caller does not know them).  Returns how many were pending and are now acknowledged.
# Idempotent: ids already acknowledged (or never delivered) are left alone. Entries whose fields the caller knows
# are forgotten in bulk (one XDEL, one HDEL, one HINCRBY per version for the whole batch), the rest one by one.
ACK = _FORGET + """
local ids, tid, ver = cmsgpack.unpack(ARGV[2]), cmsgpack.unpack(ARGV[3]), cmsgpack.unpack(ARGV[4])
local n, del, tids, counts = 0, {}, {}, {}
for i = 1, #ids do
  if redis.call('XACK', KEYS[1], ARGV[1], ids[i]) == 1 then
    n = n + 1
    if tid[i] == '' then
      forget(ids[i])
    else
      del[#del + 1] = ids[i]
      tids[#tids + 1] = tid[i]
      counts[ver[i]] = (counts[ver[i]] or 0) + 1
    end
  end
end
for v, c in pairs(counts) do
  if redis.call('HINCRBY', KEYS[2], v, -c) <= 0 then redis.call('HDEL', KEYS[2], v) end
end
for j = 1, #del, 1000 do  -- unpack() of a bounded slice: Lua's C stack takes a few thousand values at most
  local last = math.min(j + 999, #del)
  redis.call('XDEL', KEYS[1], unpack(del, j, last))
  redis.call('HDEL', KEYS[3], unpack(tids, j, last))
end
return n
"""

# KEYS: S, S:versions, S:ids, S:dead.  ARGV: group, consumer, dead-letter maxlen, then (entry id, error) pairs.
# Moves each entry that is still pending or still in the stream to the dead-letter stream with the reason and its
# payload, then acknowledges and forgets it. Returns how many were moved.
DEAD_LETTER = _FORGET + """
local n = 0
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  local was_pending = redis.call('XACK', KEYS[1], ARGV[1], id) == 1
  local present = redis.call('XRANGE', KEYS[1], id, id)[1] ~= nil
  if was_pending or present then  -- else another consumer acknowledged it meanwhile
    local payload = forget(id)
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*',
               'id', id, 'error', ARGV[i + 1], 'consumer', ARGV[2], 'payload', payload)
    n = n + 1
  end
end
return n
"""
