--[[
  unpark: remove one parked delivery and hand it back (for a replay, or to discard it).

  Atomic, so two operators replaying the same task id get it once between them.

  Input:
    KEYS[1] parked index sorted set
    KEYS[2] parked meta hash
    KEYS[3] parked body hash
    ARGV[1] task id

  Output: {code, meta JSON, body}
    OK       removed; meta and body are the parked entry's
    MISSING  no parked entry for this task id
    CORRUPT  a parking key has the wrong type; nothing removed
]]
local index, meta, bodies = KEYS[1], KEYS[2], KEYS[3]
local task_id = ARGV[1]
local bad = check_type(index, 'zset') or check_type(meta, 'hash') or check_type(bodies, 'hash')
if bad then return bad end
local entry = redis.call('HGET', meta, task_id)
if not entry then
  redis.call('ZREM', index, task_id)
  return {MISSING, '', ''}
end
local body = redis.call('HGET', bodies, task_id) or ''
redis.call('ZREM', index, task_id)
redis.call('HDEL', meta, task_id)
redis.call('HDEL', bodies, task_id)
return {OK, entry, body}
