--[[
  finish: record the owner's outcome; refused unless the caller still owns the lease.

  Terminal outcomes (succeeded, failed, revoked) drop the deadline and the stored
  message and keep the record for the retention period, so a late duplicate
  delivery is recognised. The outcome "retry" hands the lease over to the next
  attempt, which Celery has already published: the record waits for a delivery
  whose attempt is at least ARGV[6].

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] stats hash
    KEYS[4] message hash of the task
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller
    ARGV[4] outcome: succeeded | failed | revoked | retry
    ARGV[5] retention in ms
    ARGV[6] next attempt (retry only)
    ARGV[7] ms to wait for the next attempt before recovery steps in (retry only)
    KEYS[5] optional: a key written together with an accepted terminal outcome
            (a result-backend record: the outcome and its result then land
            atomically, or neither does)
    ARGV[8] optional, with KEYS[5]: value stored at KEYS[5] and published on the channel KEYS[5]
    ARGV[9] optional, with KEYS[5]: seconds KEYS[5] lives (0: no expiry)

  Output: {code, token, state}
    OK        the outcome was accepted
    LOST      another owner's token is current, or the lease was released or recovered
    FINISHED  the record was already terminal
    MISSING   there is no record for this task id
]]
local key, deadlines, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local task_id, owner, token, outcome = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local retention = tonumber(ARGV[5])

local rec = read(key, 'state', 'token', 'owner')
if not rec.state then return {8, 0, ''} end
local current = num(rec, key, 'token')
if rec.state == 'succeeded' or rec.state == 'failed' or rec.state == 'revoked' or rec.state == 'dead' then
  if current == token and rec.state == outcome then return {10, current, rec.state} end
  if current ~= token then redis.call('HINCRBY', stats, 'refused', 1) end
  return {4, current, rec.state}
end
if rec.state ~= 'active' or current ~= token or rec.owner ~= owner then
  redis.call('HINCRBY', stats, 'refused', 1)
  return {7, current, rec.state}
end

local now = now_ms()
if outcome == 'retry' then
  local deadline = now + tonumber(ARGV[7])
  redis.call('HSET', key, 'state', 'recovering', 'owner', '', 'attempt', tonumber(ARGV[6]))
  redis.call('HDEL', key, 'holder')
  redis.call('ZADD', deadlines, deadline, task_id)
  redis.call('HINCRBY', stats, 'retried', 1)
  return {10, token, 'recovering'}
end
if outcome ~= 'succeeded' and outcome ~= 'failed' and outcome ~= 'revoked' then
  return redis.error_reply('ERR finish: unknown outcome ' .. tostring(outcome) .. ' for ' .. key)
end
redis.call('HSET', key, 'state', outcome, 'finished_at', now)
redis.call('HDEL', key, 'holder')
redis.call('DEL', message)
redis.call('ZREM', deadlines, task_id)
redis.call('PEXPIRE', key, retention)
redis.call('HINCRBY', stats, outcome, 1)
if KEYS[5] then
  local expires = tonumber(ARGV[9]) or 0
  if expires > 0 then
    redis.call('SET', KEYS[5], ARGV[8], 'EX', expires)
  else
    redis.call('SET', KEYS[5], ARGV[8])
  end
  redis.call('PUBLISH', KEYS[5], ARGV[8])
end
return {10, current, outcome}
