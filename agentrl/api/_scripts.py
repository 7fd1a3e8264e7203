"""Lua scripts of the task store: each state change of a task is one atomic step on the Redis server.

Keys (``N`` = the namespace, ``{agentrl-evals}`` by default: the braces put every key in one cluster slot):

- ``N:task:<id>``     hash: status, spec, total, done, errors, attempts, worker, timestamps, metrics, error,
                      tenant, seq, bytes (its records), ibytes (its dataset), idem (its Idempotency-Key's key),
                      ix (JSON: the index keys it is in besides the status ones)
- ``N:items:<id>``    the task's dataset (JSON), frozen at submission
- ``N:results:<id>``  list of sample records (zlib-compressed JSON), in completion order
- ``N:done:<id>``     set of the sample keys (``item:sample``) in the results list: a record is stored once
- ``N:events:<id>``   stream of the task's progress events (``GET /v1/evals/{id}/events``), trimmed
- ``N:queue``         list of queued task ids (interrupted tasks go to the front)
- ``N:leases``        sorted set: running task id -> lease expiry (ms, Redis server clock)
- ``N:ix:<T>:<what>`` sorted sets: task id -> seq, for tenant ``T`` and for ``*`` (every tenant); ``what`` is
                      ``all``, ``status:<s>``, ``env:<name>`` or ``label:<len(key)>:<key>=<value>``
- ``N:seq``           the last seq: microseconds of the Redis clock at submission, made strictly increasing, so
                      a seq is unique (a listing cursor) and is the creation time (the created-range filter)
- ``N:finished``      sorted set: finished task id -> finish time (ms): what the retention sweep purges
- ``N:bytes``         bytes stored for all tasks (datasets + records): the store's bound is checked on it
- ``N:idem:<T>:<h>``  "<body hash> <task id>" of tenant T's Idempotency-Key (sha256 ``h``), expiring

Invariant: a task is ``running`` iff it has a ``worker`` and a lease; only that worker may store its records
or finish it (a fence against a worker that lost its lease but still runs). Lease expiry uses the server's
clock (``TIME``), so workers on other machines need no synchronised clocks. Every status change goes through
``set_status``, which keeps the status indexes and the finished set exact; a purge removes every key and index
entry of a task and gives its bytes back to ``N:bytes``.
"""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_LIB = """
local function ixkey(ns, tenant, what) return ns .. ':ix:' .. tenant .. ':' .. what end

local function set_status(ns, key, id, new, now_ms)
  local h = redis.call('HMGET', key, 'status', 'tenant', 'seq')
  if h[2] and h[3] then
    for _, tn in ipairs({h[2], '*'}) do
      if h[1] then redis.call('ZREM', ixkey(ns, tn, 'status:' .. h[1]), id) end
      redis.call('ZADD', ixkey(ns, tn, 'status:' .. new), h[3], id)
    end
  end
  redis.call('HSET', key, 'status', new)
  if new == 'succeeded' or new == 'failed' or new == 'cancelled' then
    redis.call('ZADD', ns .. ':finished', now_ms, id)
  end
end

local function purge(ns, id)
  local key = ns .. ':task:' .. id
  local h = redis.call('HMGET', key, 'status', 'tenant', 'ix', 'idem', 'bytes', 'ibytes')
  if not h[1] then return -1 end
  if h[2] then
    for _, tn in ipairs({h[2], '*'}) do redis.call('ZREM', ixkey(ns, tn, 'status:' .. h[1]), id) end
  end
  if h[3] then for _, k in ipairs(cjson.decode(h[3])) do redis.call('ZREM', k, id) end end
  if h[4] then
    local v = redis.call('GET', h[4])
    if v and string.sub(v, -string.len(id)) == id then redis.call('DEL', h[4]) end
  end
  local freed = tonumber(h[5] or '0') + tonumber(h[6] or '0')
  if freed > 0 then redis.call('DECRBY', ns .. ':bytes', freed) end
  redis.call('DEL', key, ns .. ':items:' .. id, ns .. ':results:' .. id, ns .. ':done:' .. id, ns .. ':events:' .. id)
  redis.call('LREM', ns .. ':queue', 0, id)
  redis.call('ZREM', ns .. ':leases', id)
  redis.call('ZREM', ns .. ':finished', id)
  redis.call('ZREM', ns .. ':index', id)
  return freed
end
"""

# ARGV: ns, id, tenant, spec JSON, items JSON, total, idem key ('' = none), body hash, idem ttl ms,
# max store bytes, environment name, labels (JSON list of 'len:key=value'). Returns {'new', id},
# {'same', id} (the key's task, same body), {'conflict', id} (other body), or {'full', bytes stored}.
SUBMIT = _LIB + """
local ns, id, tenant = ARGV[1], ARGV[2], ARGV[3]
if ARGV[7] ~= '' then
  local v = redis.call('GET', ARGV[7])
  if v then
    local sp = string.find(v, ' ', 1, true)
    local old = string.sub(v, sp + 1)
    if redis.call('EXISTS', ns .. ':task:' .. old) == 1 then
      if string.sub(v, 1, sp - 1) == ARGV[8] then return {'same', old} end
      return {'conflict', old}
    end
  end
end
local used = tonumber(redis.call('GET', ns .. ':bytes') or '0')
local size = string.len(ARGV[5])
if used + size > tonumber(ARGV[10]) then return {'full', tostring(used)} end
local t = redis.call('TIME')
local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', ns .. ':seq') or '0')
if us <= last then us = last + 1 end
local seq = string.format('%.0f', us)
redis.call('SET', ns .. ':seq', seq)
local static = {}
for _, tn in ipairs({tenant, '*'}) do
  table.insert(static, ixkey(ns, tn, 'all'))
  table.insert(static, ixkey(ns, tn, 'env:' .. ARGV[11]))
  for _, l in ipairs(cjson.decode(ARGV[12])) do table.insert(static, ixkey(ns, tn, 'label:' .. l)) end
end
for _, k in ipairs(static) do redis.call('ZADD', k, seq, id) end
for _, tn in ipairs({tenant, '*'}) do redis.call('ZADD', ixkey(ns, tn, 'status:queued'), seq, id) end
local key = ns .. ':task:' .. id
redis.call('HSET', key, 'status', 'queued', 'spec', ARGV[4], 'total', ARGV[6], 'done', 0, 'errors', 0,
  'attempts', 0, 'created_at', string.format('%.6f', us / 1000000), 'tenant', tenant, 'seq', seq, 'bytes', 0,
  'ibytes', size, 'ix', cjson.encode(static))
redis.call('SET', ns .. ':items:' .. id, ARGV[5])
redis.call('INCRBY', ns .. ':bytes', size)
redis.call('RPUSH', ns .. ':queue', id)
if ARGV[7] ~= '' then
  redis.call('SET', ARGV[7], ARGV[8] .. ' ' .. id, 'PX', ARGV[9])
  redis.call('HSET', key, 'idem', ARGV[7])
end
return {'new', id}
"""

# KEYS: the index sorted sets to intersect (the smallest drives, the others are looked up). ARGV: max seq
# ('+inf' or '(<seq>' exclusive), min seq ('-inf' or '<seq>'), limit. Returns up to limit + 1 (id, seq) pairs,
# newest first, flat (the extra one says there are more).
LIST = """
local drive, size = KEYS[1], redis.call('ZCARD', KEYS[1])
for i = 2, #KEYS do
  local c = redis.call('ZCARD', KEYS[i])
  if c < size then drive, size = KEYS[i], c end
end
local want = tonumber(ARGV[3]) + 1
local out, hi, n = {}, ARGV[1], 0
while n < want do
  local page = redis.call('ZREVRANGEBYSCORE', drive, hi, ARGV[2], 'WITHSCORES', 'LIMIT', 0, 256)
  for j = 1, #page, 2 do
    local id, ok = page[j], true
    for i = 1, #KEYS do
      if KEYS[i] ~= drive and not redis.call('ZSCORE', KEYS[i], id) then ok = false; break end
    end
    if ok then
      out[#out + 1] = id; out[#out + 1] = page[j + 1]; n = n + 1
      if n >= want then break end
    end
  end
  if #page < 512 then break end
  hi = '(' .. page[#page]
end
return out
"""

# KEYS: queue, leases. ARGV: ns, worker, lease_ms, max_attempts, now (display timestamp).
# Pops queued ids until one is still 'queued' (cancelled ones are skipped); returns it, or false.
CLAIM = _NOW + _LIB + """
while true do
  local id = redis.call('LPOP', KEYS[1])
  if not id then return false end
  local key = ARGV[1] .. ':task:' .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    local attempts = redis.call('HINCRBY', key, 'attempts', 1)
    if attempts > tonumber(ARGV[4]) then
      set_status(ARGV[1], key, id, 'failed', now)
      redis.call('HSET', key, 'finished_at', ARGV[5], 'error',
        'the task was interrupted ' .. (attempts - 1) .. ' times (its worker died each time); it is not retried again')
    else
      set_status(ARGV[1], key, id, 'running', now)
      redis.call('HSET', key, 'worker', ARGV[2])
      if redis.call('HEXISTS', key, 'started_at') == 0 then redis.call('HSET', key, 'started_at', ARGV[5]) end
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id)
      return id
    end
  end
end
"""

# KEYS: task, leases. ARGV: id, worker, lease_ms, metrics JSON ('' to keep). Returns 'running' (lease extended),
# another status (e.g. 'cancelled'), or 'lost' (another worker owns the task now, or it was purged).
HEARTBEAT = _NOW + """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker')
if st[2] ~= ARGV[2] then return 'lost' end
if st[1] ~= 'running' then return st[1] or 'lost' end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'metrics', ARGV[4]) end
return 'running'
"""

# KEYS: queue, leases. ARGV: ns. Re-queues (at the front) running tasks whose lease expired.
REAP = _NOW + _LIB + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
local n = 0
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], id)
  local key = ARGV[1] .. ':task:' .. id
  if redis.call('HGET', key, 'status') == 'running' then
    set_status(ARGV[1], key, id, 'queued', now)
    redis.call('HDEL', key, 'worker')
    redis.call('LPUSH', KEYS[1], id)
    n = n + 1
  end
end
return n
"""

# KEYS: task, queue, leases. ARGV: id, worker, ns. A worker stopping cleanly hands its task back (not an attempt).
RELEASE = _NOW + _LIB + """
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], 'worker')
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  set_status(ARGV[3], KEYS[1], ARGV[1], 'queued', now)
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: task, results, done, store bytes. ARGV: worker, sample key, record (compressed), ok ('1'/'0'),
# max bytes of the task's records, max bytes of the store. Returns 1 (stored), 0 (already stored: a duplicate),
# -1 (this worker does not own the running task), -2 (the task's records would pass their bound), -3 (the store's).
APPEND = """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker', 'bytes')
if st[1] ~= 'running' or st[2] ~= ARGV[1] then return -1 end
if redis.call('SISMEMBER', KEYS[3], ARGV[2]) == 1 then return 0 end
local n = string.len(ARGV[3])
if tonumber(st[3] or '0') + n > tonumber(ARGV[5]) then return -2 end
if tonumber(redis.call('GET', KEYS[4]) or '0') + n > tonumber(ARGV[6]) then return -3 end
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'done', 1)
redis.call('HINCRBY', KEYS[1], 'bytes', n)
redis.call('INCRBY', KEYS[4], n)
if ARGV[4] == '0' then redis.call('HINCRBY', KEYS[1], 'errors', 1) end
return 1
"""

# KEYS: task, leases. ARGV: id, worker, final status, metrics JSON, error, now, ns. A task cancelled meanwhile
# stays cancelled (its partial metrics are stored). Returns 1, or 0 when this worker does not own the task.
FINISH = _NOW + _LIB + """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker')
if st[2] ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'metrics', ARGV[4]) end
if st[1] == 'running' then
  set_status(ARGV[7], KEYS[1], ARGV[1], ARGV[3], now)
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[6])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
end
return 1
"""

# KEYS: task, queue. ARGV: id, now, ns. Returns the status before (false: no such task); queued and running tasks
# become 'cancelled' (a running task's worker sees it at its next heartbeat and stops).
CANCEL = _NOW + _LIB + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
if st == 'queued' or st == 'running' then
  if st == 'queued' then redis.call('LREM', KEYS[2], 0, ARGV[1]) end
  set_status(ARGV[3], KEYS[1], ARGV[1], 'cancelled', now)
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[2])
end
return st
"""

# KEYS: task, its events stream. ARGV: maxlen, kind, data JSON. Appends the event only while the task exists (a
# worker's late event after a purge must not leave a stream behind); returns the event id, or false.
EVENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'kind', ARGV[2], 'data', ARGV[3])
"""

# ARGV: ns, id. Removes the task, its dataset, records and index entries (a running task's worker loses its
# fence and stops). Returns the bytes freed, or -1 when there is no such task.
PURGE = _LIB + """
return purge(ARGV[1], ARGV[2])
"""

# ARGV: ns, tenant, max tasks. Indexes up to max tasks stored before the indexes existed (listed in the old
# N:index, creation time in s -> seq): tenant, seq, byte counts, the indexes, the finished set; each leaves
# N:index. Returns how many (0: done). The seq of a migrated task is its creation µs, made strictly increasing.
MIGRATE = _LIB + """
local ns, tenant = ARGV[1], ARGV[2]
local rows = redis.call('ZRANGE', ns .. ':index', 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
local last = tonumber(redis.call('GET', ns .. ':seq') or '0')
for j = 1, #rows, 2 do
  local id = rows[j]
  local key = ns .. ':task:' .. id
  local h = redis.call('HMGET', key, 'seq', 'status', 'spec', 'finished_at')
  if h[2] and not h[1] then
    local us = math.floor(tonumber(rows[j + 1]) * 1000000)
    if us <= last then us = last + 1 end
    last = us
    local seq = string.format('%.0f', us)
    local spec = cjson.decode(h[3] or '{}')
    local env = ''
    if type(spec.environment) == 'table' and type(spec.environment.name) == 'string' then
      env = spec.environment.name
    end
    local static = {}
    for _, tn in ipairs({tenant, '*'}) do
      table.insert(static, ixkey(ns, tn, 'all'))
      table.insert(static, ixkey(ns, tn, 'env:' .. env))
      if type(spec.labels) == 'table' then
        for k, v in pairs(spec.labels) do
          table.insert(static, ixkey(ns, tn, 'label:' .. string.len(k) .. ':' .. k .. '=' .. tostring(v)))
        end
      end
    end
    for _, k in ipairs(static) do redis.call('ZADD', k, seq, id) end
    for _, tn in ipairs({tenant, '*'}) do redis.call('ZADD', ixkey(ns, tn, 'status:' .. h[2]), seq, id) end
    local ib = redis.call('STRLEN', ns .. ':items:' .. id)
    local rb = 0
    for _, r in ipairs(redis.call('LRANGE', ns .. ':results:' .. id, 0, -1)) do rb = rb + string.len(r) end
    redis.call('HSET', key, 'tenant', tenant, 'seq', seq, 'bytes', rb, 'ibytes', ib, 'ix', cjson.encode(static))
    redis.call('INCRBY', ns .. ':bytes', rb + ib)
    if h[2] == 'succeeded' or h[2] == 'failed' or h[2] == 'cancelled' then
      redis.call('ZADD', ns .. ':finished', math.floor(tonumber(h[4] or '0') * 1000), id)
    end
  end
  redis.call('ZREM', ns .. ':index', id)
end
if #rows > 0 and last > tonumber(redis.call('GET', ns .. ':seq') or '0') then
  redis.call('SET', ns .. ':seq', string.format('%.0f', last))
end
return #rows / 2
"""

# ARGV: ns, ttl ms, max tasks. Purges (at most max) tasks that finished more than ttl ago by the Redis clock;
# returns how many.
EXPIRE = _NOW + _LIB + """
local ids = redis.call('ZRANGEBYSCORE', ARGV[1] .. ':finished', '-inf', now - tonumber(ARGV[2]), 'LIMIT', 0,
  tonumber(ARGV[3]))
for _, id in ipairs(ids) do
  if purge(ARGV[1], id) < 0 then redis.call('ZREM', ARGV[1] .. ':finished', id) end
end
return #ids
"""
