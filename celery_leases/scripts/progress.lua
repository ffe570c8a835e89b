--[[
  progress: the task body reports progress; pushes the progress deadline and the lease deadline.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller

  Output: {code}
    OK        progress recorded
    LOST      the caller no longer owns the lease
    FINISHED  the record is terminal
    MISSING   there is no record for this task id
]]
local key, deadlines = KEYS[1], KEYS[2]
local rec = read(key, 'state', 'token', 'owner', 'ttl', 'progress_timeout')
if not rec.state then return {8} end
if rec.state ~= 'active' then
  if rec.state == 'recovering' then return {7} end
  return {4}
end
if num(rec, key, 'token') ~= tonumber(ARGV[3]) or rec.owner ~= ARGV[2] then return {7} end
local now = now_ms()
local deadline = now + num(rec, key, 'ttl')
redis.call('HSET', key, 'progress_deadline', now + num(rec, key, 'progress_timeout'))
redis.call('ZADD', deadlines, deadline, ARGV[1])
return {10}
