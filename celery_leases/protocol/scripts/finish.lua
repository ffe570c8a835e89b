--[[
  finish: record the owner's terminal outcome; refused unless the caller still owns the lease.

  The outcome (succeeded, failed, revoked) drops the deadline and the stored
  message and keeps the record for the retention period, so a late duplicate
  delivery is recognised. (A retry hands the lease over instead: hand_over.lua.)

  Idempotent for its owner: the same finish sent again by the same owner and
  token (its first reply was lost) answers OK and changes nothing, so a caller
  that does not know whether its finish ran settles that by sending it again.
  A caller that cannot wait for ever passes ARGV[6]: a copy that reaches the
  server after that moment (a command buffered by a stalled server) is refused
  as LATE and changes nothing, so once the caller has given up no copy can
  apply the outcome behind its back.

  An outcome whose result Celery writes only after this finish (not in the
  same script: another backend or server, callbacks, a failure) may pass that
  result in ARGV[9]: it is kept in the shard's unwritten results, due at
  ARGV[10] ms from now, until the writing process confirms Celery wrote it
  (its ids ride along in a later finish, ARGV[11..]). A process that dies in
  between leaves it there, and recovery writes it (unwritten.py): an accepted
  outcome never ends without its result.

  A holder of token T finding no record (the store restarted empty, a failover
  lost the write) re-asserts it (reassert_record in _helpers.lua), then writes
  the outcome (docs/redis-deployments.md).

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] stats hash
    KEYS[4] message hash of the task
    KEYS[5] token sequence counter (raised by a re-assert)
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] token of the caller
    ARGV[4] outcome: succeeded | failed | revoked
    ARGV[5] retention in ms
    ARGV[6] server-clock ms after which this finish must not apply (0: no limit)
    KEYS[6] optional: a key written together with an accepted outcome, when ARGV[7] is not ''
            (a result-backend record: the outcome and its result then land atomically, or
            neither does); otherwise a placeholder (the record's key) for KEYS[7..8]
    ARGV[7] optional: value stored at KEYS[6] and published on the channel KEYS[6] ('': no write)
    ARGV[8] optional: seconds KEYS[6] lives (0: no expiry)
    KEYS[7] optional: unwritten results sorted set of the task's shard (with ARGV[9..])
    KEYS[8] optional: unwritten results hash of the task's shard (with ARGV[9..])
    ARGV[9] optional: the outcome's result to keep until Celery wrote it ('': none)
    ARGV[10] optional: ms from now when recovery writes a kept result nobody confirmed
    ARGV[11..] optional: ids of tasks of this shard whose kept results Celery has written since
            (confirmations riding along): dropped from KEYS[7] and KEYS[8] whatever the
            answer about this task
    (A caller sends the optional tail only as far as it uses it: each key and argument costs
    the call its time. A finish that writes and keeps nothing sends KEYS[1..5], ARGV[1..6].)

  Output: {code, token, state}, or {CORRUPT, key, field, detail}
    OK        the outcome was accepted (now, or by an earlier copy of this finish)
    LOST      another owner's token is current, or the lease was released or recovered
    FINISHED  the record was already terminal
    MISSING   there is no record for this task id and the caller holds no token (a holder re-asserts)
    LATE      the finish reached the server after ARGV[6]: nothing of this task was changed
    CORRUPT   the record, the deadline index or the token sequence is not what this
              protocol wrote; nothing written
]]
local key, deadlines, stats, message, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner, token, outcome = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local not_after = tonumber(ARGV[6]) or 0
-- The optional tail is read only as far as this call's own arguments go (finish_many.lua
-- runs this body on a slice of its arguments: past the slice are the next finish's).
local nargs = #ARGV
local result_key = nargs >= 7 and ARGV[7] ~= '' and KEYS[6]
local unwritten, unwritten_results = KEYS[7], KEYS[8]
local kept = nargs >= 9 and ARGV[9] or ''

local rec, bad = load(key, {'state', 'token', 'owner'}, {'token'}, {'token'})
if bad then return bad end
-- The deadline index is type-checked by its ZREM, the first write of an accepted finish;
-- the paths that write before it (a re-assert of a vanished record, unwritten results
-- riding along) check it first. The sequence is written only by a re-assert; the unwritten
-- results only with a kept result or confirmations riding along.
local riding = kept ~= '' or nargs >= 11
if riding or not rec.state then
  bad = check_type(deadlines, 'zset') or (not rec.state and check_type(seq, 'string'))
      or (riding and (check_type(unwritten, 'zset') or check_type(unwritten_results, 'hash')))
  if bad then return bad end
  drop_unwritten(unwritten, unwritten_results, ARGV, 11, nargs)
end
local now = now_ms()
local current = num(rec, key, 'token')
-- The same finish again (its first reply was lost): already applied, answer as then.
if current == token and token > 0 and rec.state == outcome and is_terminal(outcome)
    and rec.owner == owner then
  return {OK, current, outcome}
end
if not_after > 0 and now > not_after then
  count(stats, 'late_finishes', 1)
  return {LATE, current, rec.state or ''}
end
if outcome ~= 'succeeded' and outcome ~= 'failed' and outcome ~= 'revoked' then
  return redis.error_reply('ERR finish: unknown outcome ' .. tostring(outcome) .. ' for ' .. key)
end
bad = owner_guard(key, seq, stats, rec, current, task_id, owner, token, now)
if bad then return bad end
-- Accepted: the outcome's writes, the deadline's first (its type check).
if wrong_type(redis.pcall('ZREM', deadlines, task_id)) then
  return corrupt(deadlines, 'type', 'is not a sorted set (' .. redis.call('TYPE', deadlines).ok .. ')')
end
-- (An empty holder matches no one's token: one write instead of an HDEL.)
redis.call('HSET', key, 'state', outcome, 'finished_at', now, 'holder', '')
redis.call('DEL', message)
redis.call('PEXPIRE', key, ARGV[5])
count(stats, outcome, 1)
if result_key then
  if (tonumber(ARGV[8]) or 0) > 0 then
    redis.call('SET', result_key, ARGV[7], 'EX', ARGV[8])
  else
    redis.call('SET', result_key, ARGV[7])
  end
  redis.call('PUBLISH', result_key, ARGV[7])
end
if kept ~= '' then
  redis.call('HSET', unwritten_results, task_id, kept)
  redis.call('ZADD', unwritten, now + (tonumber(ARGV[10]) or 0), task_id)
end
return {OK, token, outcome}
