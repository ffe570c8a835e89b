--[[
  hand_over: the owner's retry (self.retry()) hands the lease to the next attempt.

  Celery has already published the next attempt under the same task id: the
  record turns recovering with no owner and waits for a delivery whose attempt
  is at least ARGV[4] (acquire.lua); if none acquires within ARGV[5] ms, a
  recovery pass re-publishes it. With publish tracking (ARGV[8] > 0) the record
  waits in the queued index instead of the deadline index, as a task recorded at
  publish does: due ARGV[7] ms from now (the retry's countdown), scored due +
  delivery timeout, its streak of undelivered re-publishes reset to 0, so a copy
  the broker loses, or one stuck behind a backlog, is re-published by
  claim_undelivered.lua with its backoff. Idempotent for its owner and refused as LATE
  after ARGV[6], as finish.lua is. A holder of token T finding no record
  re-asserts it first (reassert_record in _helpers.lua). The record keeps the token it
  was handed over under (handed_over), so a renewal of that token racing the worker's
  forget is told FINISHED, not LOST (renew_many.lua): the owner gave it up.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] stats hash
    KEYS[4] token sequence counter (raised by a re-assert)
    KEYS[5] queued index sorted set (written only with publish tracking)
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller
    ARGV[4] next attempt (Celery's retries of the published retry)
    ARGV[5] ms to wait for the next attempt before recovery steps in
    ARGV[6] server-clock ms after which this hand-over must not apply (0: no limit)
    ARGV[7] ms from now until the next attempt is due (its countdown; used with publish tracking)
    ARGV[8] delivery timeout in ms; 0: publish tracking is off

  Output: {code, token, state}, or {CORRUPT, key, field, detail}
    OK        handed over (now, or by an earlier copy of this call): state recovering
    LOST      another owner's token is current, or the lease was released or recovered
    FINISHED  the record was already terminal
    MISSING   there is no record for this task id and the caller holds no token
    LATE      the call reached the server after ARGV[6]: nothing was changed
    CORRUPT   the record, the deadline index, the queued index (with tracking) or the
              token sequence is not what this protocol wrote; nothing written
]]
local key, deadlines, stats, seq, queued = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner, token = ARGV[1], ARGV[2], tonumber(ARGV[3])
local next_attempt, grace = tonumber(ARGV[4]), tonumber(ARGV[5])
local not_after = tonumber(ARGV[6]) or 0
local countdown, timeout = tonumber(ARGV[7]) or 0, tonumber(ARGV[8]) or 0

local rec, bad = load(key, {'state', 'token', 'owner', 'attempt'}, {'token', 'attempt'}, {'token'})
if bad then return bad end
bad = check_type(deadlines, 'zset') or check_type(seq, 'string')
if not bad and timeout > 0 then bad = check_type(queued, 'zset') end
if bad then return bad end
local now = now_ms()
local current = num(rec, key, 'token')
-- The same hand-over again (its first reply was lost): already applied, answer as then.
if rec.state == 'recovering' and current == token and token > 0 and next_attempt > 0
    and num(rec, key, 'attempt') == next_attempt then
  return {OK, current, rec.state}
end
if not_after > 0 and now > not_after then
  count(stats, 'late_finishes', 1)
  return {LATE, current, rec.state or ''}
end
bad = owner_guard(key, seq, stats, rec, current, task_id, owner, token, now)
if bad then return bad end
redis.call('HSET', key, 'state', 'recovering', 'owner', '', 'attempt', next_attempt, 'handed_over', token)
redis.call('HDEL', key, 'holder')
if timeout > 0 then
  redis.call('ZREM', deadlines, task_id)
  redis.call('HSET', key, 'due', now + countdown, 'undelivered_streak', 0)
  redis.call('ZADD', queued, now + countdown + timeout, task_id)
else
  redis.call('ZADD', deadlines, now + grace, task_id)
end
count(stats, 'retried', 1)
return {OK, token, 'recovering'}
