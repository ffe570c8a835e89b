--[[
  progress: the task body reports progress; pushes the progress deadline and the lease deadline.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller

  Output: {code}, or {CORRUPT, key, field, detail}
    OK        progress recorded
    LOST      the caller no longer owns the lease
    FINISHED  the record is terminal
    MISSING   there is no record for this task id
    CORRUPT   the record or the deadline index is not what this protocol wrote; nothing written
]]
local key, deadlines = KEYS[1], KEYS[2]
local rec, bad = load(key, {'state', 'token', 'owner', 'ttl', 'progress_timeout'},
                      {'token', 'ttl', 'progress_timeout'}, {'token', 'ttl'})
if bad then return bad end
bad = check_type(deadlines, 'zset')
if bad then return bad end
if not rec.state then return {MISSING} end
if rec.state ~= 'active' then
  if rec.state == 'recovering' then return {LOST} end
  return {FINISHED}
end
if num(rec, key, 'token') ~= tonumber(ARGV[3]) or rec.owner ~= ARGV[2] then return {LOST} end
local now = now_ms()
local deadline = now + num(rec, key, 'ttl')
redis.call('HSET', key, 'progress_deadline', now + num(rec, key, 'progress_timeout'))
redis.call('ZADD', deadlines, deadline, ARGV[1])
return {OK}
