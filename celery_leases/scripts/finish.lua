--[[
  finish: record the owner's outcome; refused unless the caller still owns the lease.

  Terminal outcomes (succeeded, failed, revoked) drop the deadline and the stored
  message and keep the record for the retention period, so a late duplicate
  delivery is recognised. The outcome "retry" hands the lease over to the next
  attempt, which Celery has already published: the record waits for a delivery
  whose attempt is at least ARGV[6].

  Idempotent for its owner: the same finish sent again by the same owner and
  token (its first reply was lost) answers OK and changes nothing, so a caller
  that does not know whether its finish ran settles that by sending it again.
  A caller that cannot wait for ever passes ARGV[8]: a copy that reaches the
  server after that moment (a command buffered by a stalled server) is refused
  as LATE and changes nothing, so once the caller has given up no copy can
  apply the outcome behind its back.

  A holder of token T finding no record (the store restarted empty, a failover
  lost the write) re-asserts it, as the heartbeat's acquire does: the record is
  written with token T and the outcome, and the token sequence is raised to T
  so no later acquire can hand out T or below again (docs/redis-deployments.md).

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] stats hash
    KEYS[4] message hash of the task
    KEYS[5] token sequence counter (raised by a re-assert)
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller
    ARGV[4] outcome: succeeded | failed | revoked | retry
    ARGV[5] retention in ms
    ARGV[6] next attempt (retry only)
    ARGV[7] ms to wait for the next attempt before recovery steps in (retry only)
    ARGV[8] server-clock ms after which this finish must not apply (0: no limit)
    KEYS[6] optional: a key written together with an accepted terminal outcome
            (a result-backend record: the outcome and its result then land
            atomically, or neither does)
    ARGV[9] optional, with KEYS[6]: value stored at KEYS[6] and published on the channel KEYS[6]
    ARGV[10] optional, with KEYS[6]: seconds KEYS[6] lives (0: no expiry)

  Output: {code, token, state}, or {CORRUPT, key, field, detail}
    OK        the outcome was accepted (now, or by an earlier copy of this finish)
    LOST      another owner's token is current, or the lease was released or recovered
    FINISHED  the record was already terminal
    MISSING   there is no record for this task id and the caller holds no token (a holder re-asserts)
    LATE      the finish reached the server after ARGV[8]: nothing was changed
    CORRUPT   the record, the deadline index or the token sequence is not what this
              protocol wrote; nothing written
]]
local key, deadlines, stats, message, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner, token, outcome = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local retention = tonumber(ARGV[5])
local not_after = tonumber(ARGV[8]) or 0
local result_key = KEYS[6]

local function write_result()
  if result_key then
    local expires = tonumber(ARGV[10]) or 0
    if expires > 0 then
      redis.call('SET', result_key, ARGV[9], 'EX', expires)
    else
      redis.call('SET', result_key, ARGV[9])
    end
    redis.call('PUBLISH', result_key, ARGV[9])
  end
end

local rec, bad = load(key, {'state', 'token', 'owner', 'attempt'}, {'token', 'attempt'}, {'token'})
if bad then return bad end
bad = check_type(deadlines, 'zset') or check_type(seq, 'string')
if bad then return bad end
local now = now_ms()
local current = num(rec, key, 'token')
local terminal = rec.state == 'succeeded' or rec.state == 'failed' or rec.state == 'revoked' or rec.state == 'dead'
-- The same finish again (its first reply was lost): already applied, answer as then.
if rec.state and current == token and token > 0 then
  if terminal and rec.state == outcome and rec.owner == owner then return {10, current, rec.state} end
  if outcome == 'retry' and rec.state == 'recovering' and tonumber(ARGV[6]) > 0
      and num(rec, key, 'attempt') == tonumber(ARGV[6]) then
    return {10, current, rec.state}
  end
end
if not_after > 0 and now > not_after then
  count(stats, 'late_finishes', 1)
  return {20, current, rec.state or ''}
end
if outcome ~= 'succeeded' and outcome ~= 'failed' and outcome ~= 'revoked' and outcome ~= 'retry' then
  return redis.error_reply('ERR finish: unknown outcome ' .. tostring(outcome) .. ' for ' .. key)
end
if not rec.state then
  if token <= 0 then return {8, 0, ''} end
  -- Re-assert: the caller held token T when the record vanished.
  local tok = string.format('%d', token)
  local raw = redis.call('GET', seq)
  local seen = raw and whole(raw) or 0
  if raw and not whole(raw) then return corrupt(seq, 'value', 'is not a number: ' .. string.format('%q', raw)) end
  if seen < token then redis.call('SET', seq, tok) end
  redis.call('HSET', key, 'task_id', task_id, 'token', tok, 'owner', owner, 'acquired_at', now,
             history_fields(key, 0, tok .. '@' .. owner .. '@' .. string.format('%d', now)))
  count(stats, 'reasserted', 1)
  if outcome == 'retry' then
    redis.call('HSET', key, 'state', 'recovering', 'owner', '', 'attempt', tonumber(ARGV[6]))
    redis.call('ZADD', deadlines, now + tonumber(ARGV[7]), task_id)
    count(stats, 'retried', 1)
    return {10, token, 'recovering'}
  end
  redis.call('HSET', key, 'state', outcome, 'finished_at', now)
  redis.call('DEL', message)
  redis.call('ZREM', deadlines, task_id)
  redis.call('PEXPIRE', key, retention)
  count(stats, outcome, 1)
  write_result()
  return {10, token, outcome}
end
if terminal then
  if current ~= token then count(stats, 'refused', 1) end
  return {4, current, rec.state}
end
if rec.state ~= 'active' or current ~= token or rec.owner ~= owner then
  count(stats, 'refused', 1)
  return {7, current, rec.state}
end

if outcome == 'retry' then
  local deadline = now + tonumber(ARGV[7])
  redis.call('HSET', key, 'state', 'recovering', 'owner', '', 'attempt', tonumber(ARGV[6]))
  redis.call('HDEL', key, 'holder')
  redis.call('ZADD', deadlines, deadline, task_id)
  count(stats, 'retried', 1)
  return {10, token, 'recovering'}
end
redis.call('HSET', key, 'state', outcome, 'finished_at', now)
redis.call('HDEL', key, 'holder')
redis.call('DEL', message)
redis.call('ZREM', deadlines, task_id)
redis.call('PEXPIRE', key, retention)
count(stats, outcome, 1)
write_result()
return {10, current, outcome}
