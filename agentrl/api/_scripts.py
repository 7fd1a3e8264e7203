"""Lua scripts of the task store: each state change of a task is one atomic step on the Redis server.

Keys (``N`` = the namespace, ``{agentrl-evals}`` by default: the braces put every key in one cluster slot):

- ``N:task:<id>``     hash: status, spec, total, done, errors, attempts, worker, timestamps, metrics, error
- ``N:items:<id>``    the task's dataset (JSON), frozen at submission
- ``N:results:<id>``  list of sample records (JSON), in completion order
- ``N:done:<id>``     set of the sample keys (``item:sample``) in the results list: a record is stored once
- ``N:queue``         list of queued task ids (interrupted tasks go to the front)
- ``N:leases``        sorted set: running task id -> lease expiry (ms, Redis server clock)
- ``N:index``         sorted set: task id -> creation time (for listing)

Invariant: a task is ``running`` iff it has a ``worker`` and a lease; only that worker may store its records
or finish it (a fence against a worker that lost its lease but still runs). Lease expiry uses the server's
clock (``TIME``), so workers on other machines need no synchronised clocks.
"""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: queue, leases. ARGV: task key prefix, worker, lease_ms, max_attempts, now (display timestamp).
# Pops queued ids until one is still 'queued' (cancelled ones are skipped); returns it, or false.
CLAIM = _NOW + """
while true do
  local id = redis.call('LPOP', KEYS[1])
  if not id then return false end
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'status') == 'queued' then
    local attempts = redis.call('HINCRBY', key, 'attempts', 1)
    if attempts > tonumber(ARGV[4]) then
      redis.call('HSET', key, 'status', 'failed', 'finished_at', ARGV[5], 'error',
        'the task was interrupted ' .. (attempts - 1) .. ' times (its worker died each time); it is not retried again')
    else
      redis.call('HSET', key, 'status', 'running', 'worker', ARGV[2])
      if redis.call('HEXISTS', key, 'started_at') == 0 then redis.call('HSET', key, 'started_at', ARGV[5]) end
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id)
      return id
    end
  end
end
"""

# KEYS: task, leases. ARGV: id, worker, lease_ms, metrics JSON ('' to keep). Returns 'running' (lease extended),
# another status (e.g. 'cancelled'), or 'lost' (another worker owns the task now).
HEARTBEAT = _NOW + """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker')
if st[2] ~= ARGV[2] then return 'lost' end
if st[1] ~= 'running' then return st[1] or 'lost' end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'metrics', ARGV[4]) end
return 'running'
"""

# KEYS: queue, leases. ARGV: task key prefix. Re-queues (at the front) running tasks whose lease expired.
REAP = _NOW + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
local n = 0
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], id)
  local key = ARGV[1] .. id
  if redis.call('HGET', key, 'status') == 'running' then
    redis.call('HSET', key, 'status', 'queued')
    redis.call('HDEL', key, 'worker')
    redis.call('LPUSH', KEYS[1], id)
    n = n + 1
  end
end
return n
"""

# KEYS: task, queue, leases. ARGV: id, worker. A worker stopping cleanly hands its task back (not an attempt).
RELEASE = """
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], 'worker')
if redis.call('HGET', KEYS[1], 'status') == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'queued')
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
  redis.call('LPUSH', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: task, results, done. ARGV: worker, sample key, record JSON, ok ('1'/'0').
# Returns 1 (stored), 0 (already stored: a duplicate), -1 (this worker does not own the running task).
APPEND = """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker')
if st[1] ~= 'running' or st[2] ~= ARGV[1] then return -1 end
if redis.call('SADD', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'done', 1)
if ARGV[4] == '0' then redis.call('HINCRBY', KEYS[1], 'errors', 1) end
return 1
"""

# KEYS: task, leases. ARGV: id, worker, final status, metrics JSON, error, now. A task cancelled meanwhile stays
# cancelled (its partial metrics are stored). Returns 1, or 0 when this worker does not own the task.
FINISH = """
local st = redis.call('HMGET', KEYS[1], 'status', 'worker')
if st[2] ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'metrics', ARGV[4]) end
if st[1] == 'running' then
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_at', ARGV[6])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
end
return 1
"""

# KEYS: task, queue. ARGV: id, now. Returns the status before (false: no such task); queued and running tasks
# become 'cancelled' (a running task's worker sees it at its next heartbeat and stops).
CANCEL = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
if st == 'queued' or st == 'running' then
  if st == 'queued' then redis.call('LREM', KEYS[2], 0, ARGV[1]) end
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2])
end
return st
"""
