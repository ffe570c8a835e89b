--[[
  claim_unwritten: hand out the kept results whose writing process never confirmed them.

  finish.lua keeps the result of an accepted outcome that Celery writes only
  afterwards, due a while after the finish. A process that wrote it confirms
  it (results_written.lua, or riding along a later finish); one that died in
  between never does. This script lists up to ARGV[2] entries whose due time
  passed (server clock), pushes each one's due time ARGV[1] ms ahead, so that
  a concurrent pass does not take it too and a caller that dies or fails is
  handed it again later, and returns them. The caller writes each result unless
  the backend already holds one, then confirms it (results_written.lua). An
  entry whose kept result is gone only leaves the index.

  Input:
    KEYS[1] unwritten results sorted set of a shard
    KEYS[2] unwritten results hash of that shard
    ARGV[1] ms the due time of a handed-out entry moves ahead
    ARGV[2] most entries handed out

  Output: a flat list {task id, kept result, ...}, or {CORRUPT, key, field, detail}
          when a key is not of its type
    CORRUPT  KEYS[1] is not a sorted set or KEYS[2] not a hash; nothing written
]]
local index, results = KEYS[1], KEYS[2]
local delay, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if not (delay and delay > 0 and limit and limit > 0) then
  return redis.error_reply('ERR claim_unwritten: delay and limit must be positive numbers')
end
local bad = check_type(index, 'zset') or check_type(results, 'hash')
if bad then return bad end
local now = now_ms()
local out = {}
for _, task_id in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, limit)) do
  local kept = redis.call('HGET', results, task_id)
  if kept then
    redis.call('ZADD', index, now + delay, task_id)
    table.insert(out, task_id)
    table.insert(out, kept)
  else
    redis.call('ZREM', index, task_id)
  end
end
return out
