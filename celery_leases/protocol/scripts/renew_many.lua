--[[
  renew_many: push the deadline of every lease one owner holds, in one call.

  A lease is renewed only while its record's holder is "<token>@<owner>" (set
  by acquire; cleared by every transition that ends or moves ownership), so
  the common case reads one field per lease. Leases with a progress timeout
  are renewed by a call with ARGV[3] = 1: a lease whose progress deadline
  passed is stripped of its owner and made due at once (the stuck-handler
  case), so recovery can claim it.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2] stats hash
    KEYS[3..n] record hash of each lease, in the order of the tokens below
    ARGV[1] owner (worker instance id)
    ARGV[2] ttl in ms of these leases
    ARGV[3] 1 to enforce progress deadlines, 0 not to
    ARGV[4] length of the record key prefix (the task id follows it)
    ARGV[k+2] token of the lease whose record is KEYS[k]

  Output: flat list {task id, code, task id, code, ...} of the leases NOT renewed
  (a CORRUPT entry has a third element: the field and what is wrong with it), or
  {CORRUPT, key, field, detail} when the deadline index is not a sorted set
    LOST      the caller no longer owns this lease
    FINISHED  the record is terminal under the caller's token, or the caller handed it
              over to its next attempt (a retry): nothing to renew, nothing lost
    MISSING   there is no record for this task id
    STALLED   the progress timeout passed: the lease was taken from the caller
    CORRUPT   the record is not what this protocol wrote (not a hash, an unknown or missing
              state, a progress deadline that is not a number): not renewed, nothing written
]]
local deadlines, stats = KEYS[1], KEYS[2]
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local suffix = '@' .. ARGV[1]
local now = now_ms()
local deadline = now + tonumber(ARGV[2])
local check_progress = ARGV[3] == '1'
local skip = tonumber(ARGV[4]) + 1
local out = {}
local zargs = {}
local stalled = 0

for k = 3, #KEYS do
  local key = KEYS[k]
  local token = ARGV[k + 2]
  local task_id = string.sub(key, skip)
  -- The hot path reads holder and state and compares them; anything else goes to the
  -- checks below, where a corrupt record is reported for its task alone.
  local v
  if check_progress then
    v = redis.pcall('HMGET', key, 'holder', 'state', 'progress_deadline')
  else
    v = redis.pcall('HMGET', key, 'holder', 'state')
  end
  local bad_record
  if wrong_type(v) then
    bad_record = corrupt(key, 'type', 'is not a hash (' .. redis.call('TYPE', key).ok .. ')')
  elseif v[1] == token .. suffix and v[2] == 'active' then
    local progress_deadline = 0
    if check_progress and v[3] then
      progress_deadline = whole(v[3])
      if not progress_deadline then
        bad_record = corrupt(key, 'progress_deadline', 'is not a number: ' .. string.format('%q', v[3]))
      end
    end
    if bad_record then
      -- reported below
    elseif check_progress and progress_deadline > 0 and now > progress_deadline then
      redis.call('HSET', key, 'owner', '')
      redis.call('HDEL', key, 'holder')
      table.insert(zargs, now); table.insert(zargs, task_id)
      stalled = stalled + 1
      table.insert(out, task_id); table.insert(out, STALLED)
    else
      table.insert(zargs, deadline); table.insert(zargs, task_id)
    end
  elseif v[2] and not KNOWN_STATES[v[2]] then
    bad_record = corrupt(key, 'state', 'is ' .. string.format('%q', v[2]) .. ', not a known state')
  elseif not v[2] and redis.call('EXISTS', key) == 1 then
    bad_record = corrupt(key, 'state', 'is missing')
  else
    -- Not ours any more: find out why (rare, so the extra read is fine).
    local current, handed = unpack(redis.call('HMGET', key, 'token', 'handed_over'))
    local code = LOST
    if not v[2] then
      code = MISSING
    elseif current == token and ((v[2] ~= 'active' and v[2] ~= 'recovering')
                                 or (v[2] == 'recovering' and handed == token)) then
      code = FINISHED
    end
    table.insert(out, task_id); table.insert(out, code)
  end
  if bad_record then
    table.insert(out, task_id); table.insert(out, CORRUPT)
    table.insert(out, bad_record[3] .. ' ' .. bad_record[4])
  end
  if #zargs >= 4000 then
    redis.call('ZADD', deadlines, unpack(zargs))
    zargs = {}
  end
end
if #zargs > 0 then redis.call('ZADD', deadlines, unpack(zargs)) end
if stalled > 0 then count(stats, 'stalled', stalled) end
return out
