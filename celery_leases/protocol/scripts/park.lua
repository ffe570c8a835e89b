--[[
  park: keep a delivery that must not run (a corrupt record, a malformed message) for an operator.

  Never touches the task's lease record: a corrupt record stays as it is, to be
  inspected. The parked entry is the delivery's message (body, envelope) and
  why it was parked; parking the same task id again replaces the entry and
  counts it. Bounded: entries older than the retention, and the oldest beyond
  the cap, are dropped here (the count of dropped entries is returned).

  Input:
    KEYS[1] parked index sorted set (task id -> parked_at ms)
    KEYS[2] parked meta hash (task id -> JSON)
    KEYS[3] parked body hash (task id -> body)
    ARGV[1] task id
    ARGV[2] reason
    ARGV[3] task name
    ARGV[4] message body ('' when none)
    ARGV[5] message envelope, JSON ('' when none)
    ARGV[6] key that was corrupt ('' when none)
    ARGV[7] field that was corrupt ('' when none)
    ARGV[8] retention in ms of parked entries
    ARGV[9] most entries kept

  Output: {code, dropped}
    OK       parked; dropped entries (over the retention or the cap) were removed
    CORRUPT  a parking key has the wrong type, or the entry is unreadable; nothing written
]]
local index, meta, bodies = KEYS[1], KEYS[2], KEYS[3]
local task_id = ARGV[1]
local bad = check_type(index, 'zset') or check_type(meta, 'hash') or check_type(bodies, 'hash')
if bad then return bad end
local count = 0
local previous = redis.call('HGET', meta, task_id)
if previous then
  local ok, entry = pcall(cjson.decode, previous)
  if ok and type(entry) == 'table' then count = tonumber(entry.count) or 0 end
end

local now = now_ms()
local entry = cjson.encode({task_id = task_id, reason = ARGV[2], name = ARGV[3], envelope = ARGV[5],
                            key = ARGV[6], field = ARGV[7], parked_at = now, count = count + 1,
                            body_size = string.len(ARGV[4])})
redis.call('HSET', meta, task_id, entry)
redis.call('HSET', bodies, task_id, ARGV[4])
redis.call('ZADD', index, now, task_id)

-- Bounds: by age, then by number (oldest first).
local dropped = 0
local old = redis.call('ZRANGEBYSCORE', index, '-inf', now - tonumber(ARGV[8]), 'LIMIT', 0, 1000)
local over = redis.call('ZCARD', index) - #old - tonumber(ARGV[9])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', index, #old, #old + math.min(over, 1000) - 1)) do
    table.insert(old, id)
  end
end
for _, id in ipairs(old) do
  if id ~= task_id then
    redis.call('ZREM', index, id)
    redis.call('HDEL', meta, id)
    redis.call('HDEL', bodies, id)
    dropped = dropped + 1
  end
end
return {OK, dropped}
