"""Lua scripts of the trajectory queue: each one is a single atomic step on the server.

Keys of a queue on stream S (all in one hash slot when S contains a ``{hash tag}``):

- ``S``            the stream; entry fields ``i`` (trajectory id) and ``v`` (oldest weight version). An entry may
                   also carry its payload inline in field ``t`` (what a foreign producer's plain XADD would do);
- ``S:payloads``   hash  trajectory id -> msgpack payload, for the entries ``put`` made;
- ``S:versions``   hash  version -> number of unacknowledged entries of that version;
- ``S:ids``        hash  trajectory id -> entry id, for entries in the stream (makes ``put`` retries idempotent);
- ``S:dead``       dead-letter stream: fields ``id``, ``error``, ``consumer``, ``payload``.

Payloads travel outside the scripts on purpose: handing a 50 KB argument to Lua copies it twice, which cost more
than the XADD itself (Redis 7 worst). ``put`` writes the payload with a plain HSET *before* the script adds
the entry, in the same pipeline, so a consumer never sees an entry whose payload is not there yet.

Invariant kept by the scripts: an entry is in ``S`` iff it is counted in ``S:versions`` and indexed in
``S:ids``; acknowledging deletes it and its payload (the stream holds exactly the unacknowledged entries, so
``XLEN S`` is the queue length used for backpressure).
"""

# Removes entry `id` (already XACK-ed) from the stream, its payload and the side tables. `tid`/`ver` are its
# fields 'i' and 'v' when the caller knows them, else false (then they are read from the (small) entry).
# Returns its payload, or '' when it has none.
_FORGET = """
local function forget(id, tid, ver, want_payload)
  local payload = ''
  if not tid then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    if not e[1] then return '' end
    local f = e[1][2]
    for j = 1, #f, 2 do
      if f[j] == 'i' then tid = f[j + 1] elseif f[j] == 'v' then ver = f[j + 1] elseif f[j] == 't' then payload = f[j + 1] end
    end
  end
  if ver then
    if redis.call('HINCRBY', KEYS[2], ver, -1) <= 0 then redis.call('HDEL', KEYS[2], ver) end
  end
  if tid then
    if redis.call('HGET', KEYS[3], tid) == id then redis.call('HDEL', KEYS[3], tid) end
    if want_payload and payload == '' then payload = redis.call('HGET', KEYS[4], tid) or '' end
    redis.call('HDEL', KEYS[4], tid)
  end
  redis.call('XDEL', KEYS[1], id)
  return payload
end
"""

# KEYS: S, S:versions, S:ids, S:payloads.  ARGV: capacity, then (trajectory_id, version) pairs whose payloads
# the caller wrote to S:payloads just before. Admits the longest prefix of the batch that fits under `capacity`
# unacknowledged entries and whose payloads are there; a trajectory id already in the stream is not added again
# (its existing entry id is returned). Returns the entry ids of the admitted prefix.
PUT = """
local cap = tonumber(ARGV[1])
local len = redis.call('XLEN', KEYS[1])
local out = {}
for i = 2, #ARGV, 2 do
  local tid, ver = ARGV[i], ARGV[i + 1]
  local existing = redis.call('HGET', KEYS[3], tid)
  if existing and not redis.call('XRANGE', KEYS[1], existing, existing)[1] then existing = false end
  if existing then
    out[#out + 1] = existing
  else
    if len >= cap or redis.call('HEXISTS', KEYS[4], tid) == 0 then break end
    local id = redis.call('XADD', KEYS[1], '*', 'i', tid, 'v', ver)
    redis.call('HSET', KEYS[3], tid, id)
    redis.call('HINCRBY', KEYS[2], ver, 1)
    len = len + 1
    out[#out + 1] = id
  end
end
return out
"""

# KEYS: S, S:payloads.  ARGV: group, consumer, count.  A non-blocking XREADGROUP of new entries that also fetches
# their payloads: one round trip instead of two when entries are waiting (the consumer falls back to a blocking
# XREADGROUP, then HMGET, when there are none). Returns (entry id, flat field list, payload or false) triples.
READ = """
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if not r then return {} end
local out = {}
for k, e in ipairs(r[1][2]) do
  local f, tid, inline = e[2], false, false
  for j = 1, #f, 2 do
    if f[j] == 'i' then tid = f[j + 1] elseif f[j] == 't' then inline = true end
  end
  local payload = false
  if tid and not inline then payload = redis.call('HGET', KEYS[2], tid) end
  out[k] = {e[1], f, payload}
end
return out
"""

# KEYS: S:ids, S:payloads.  ARGV: trajectory ids whose payloads a put wrote but could not enqueue. Deletes those
# payloads, except for ids that are in the stream (a retried put of an entry already queued).
UNSTAGE = """
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then redis.call('HDEL', KEYS[2], ARGV[i]) end
end
return 1
"""

# KEYS: S, S:versions, S:ids, S:payloads.  ARGV: group, then (entry id, trajectory id, version) triples where the
# last two are '' when the caller does not know them.  Returns how many were pending and are now acknowledged.
# Idempotent: ids already acknowledged (or never delivered) are left alone.
ACK = _FORGET + """
local n = 0
for i = 2, #ARGV, 3 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    local tid, ver = ARGV[i + 1], ARGV[i + 2]
    if tid == '' then tid = false; ver = false end
    forget(ARGV[i], tid, ver, false)
    n = n + 1
  end
end
return n
"""

# KEYS: S, S:versions, S:ids, S:payloads, S:dead.  ARGV: group, consumer, dead-letter maxlen, then
# (entry id, error, force) triples.  Moves each entry that is still pending or still in the stream (or any entry,
# with force = '1') to the dead-letter stream with the reason and its payload, then acknowledges and forgets it.
# Returns how many were moved.
DEAD_LETTER = _FORGET + """
local n = 0
for i = 4, #ARGV, 3 do
  local id = ARGV[i]
  local was_pending = redis.call('XACK', KEYS[1], ARGV[1], id) == 1
  local present = redis.call('XRANGE', KEYS[1], id, id)[1] ~= nil
  if was_pending or present or ARGV[i + 2] == '1' then  -- else another consumer acknowledged it meanwhile
    local payload = forget(id, false, false, true)
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[3], '*',
               'id', id, 'error', ARGV[i + 1], 'consumer', ARGV[2], 'payload', payload)
    n = n + 1
  end
end
return n
"""

# KEYS: S.  ARGV: group, consumer, entry ids.  For the ids still pending at `consumer`, resets their idle time
# (so reclaim() elsewhere does not take them) and returns them; ids owned by another consumer are left alone.
RENEW = """
local owned = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if p[1] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""
