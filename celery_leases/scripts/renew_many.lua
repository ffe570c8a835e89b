--[[
  renew_many: push the deadline of every lease one owner holds, in one call.

  A lease is renewed only while the record is active under the caller's owner
  id and token. A lease whose progress timeout passed is stripped of its owner
  and made due at once (the stuck-handler case), so recovery can claim it.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2] stats hash
    KEYS[3..n] record hash of each lease, in the order of the pairs below
    ARGV[1] owner (worker instance id)
    ARGV[2k], ARGV[2k+1] task id and token of the lease whose record is KEYS[k+2]

  Output: flat list {task id, code, task id, code, ...} of the leases NOT renewed
    LOST      the caller no longer owns this lease
    FINISHED  the record is terminal under the caller's token (nothing to renew)
    MISSING   there is no record for this task id
    STALLED   the progress timeout passed: the lease was taken from the caller
]]
local deadlines, stats = KEYS[1], KEYS[2]
local owner = ARGV[1]
local now = now_ms()
local out = {}
local zargs = {}
local stalled = 0

local function flush()
  if #zargs > 0 then
    redis.call('ZADD', deadlines, unpack(zargs))
    zargs = {}
  end
end

for k = 3, #KEYS do
  local key = KEYS[k]
  local task_id, token = ARGV[2 * k - 4], tonumber(ARGV[2 * k - 3])
  local v = redis.call('HMGET', key, 'state', 'token', 'owner', 'ttl', 'progress_timeout', 'progress_deadline')
  local state, current = v[1], tonumber(v[2])
  if not state then
    table.insert(out, task_id); table.insert(out, 8)
  elseif current ~= token then
    table.insert(out, task_id); table.insert(out, 7)
  elseif state ~= 'active' then
    if state == 'recovering' then
      table.insert(out, task_id); table.insert(out, 7)
    else
      table.insert(out, task_id); table.insert(out, 4)
    end
  elseif v[3] ~= owner then
    table.insert(out, task_id); table.insert(out, 7)
  else
    local progress_timeout = tonumber(v[5]) or 0
    if progress_timeout > 0 and now > (tonumber(v[6]) or 0) then
      redis.call('HSET', key, 'owner', '', 'deadline', now)
      table.insert(zargs, now); table.insert(zargs, task_id)
      stalled = stalled + 1
      table.insert(out, task_id); table.insert(out, 9)
    else
      local ttl = tonumber(v[4])
      if ttl == nil then
        error({err = 'CORRUPT ' .. key .. ' field ttl is not a number: ' .. tostring(v[4])})
      end
      redis.call('HSET', key, 'deadline', now + ttl)
      table.insert(zargs, now + ttl); table.insert(zargs, task_id)
    end
  end
  if #zargs >= 4000 then flush() end
end
flush()
if stalled > 0 then redis.call('HINCRBY', stats, 'stalled', stalled) end
return out
