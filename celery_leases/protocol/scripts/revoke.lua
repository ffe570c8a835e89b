--[[
  revoke: end a task's lease because Celery revoked it or its message expired, unless it finished.

  A revoke never touches a finished task (its stored result stays). A task
  nobody runs now (no record yet, recovering, or an owner that stopped
  renewing) becomes terminal revoked: its stored message is dropped and it
  leaves the deadline index, so no later delivery or recovery runs it. A task
  with a live owner other than the caller is not stopped (Celery does not stop
  a running task on a plain revoke, and an owner that started before its
  message expired keeps it): a plain revoke is then remembered in the record
  (revoke_requested), so the owner's own outcome stands but, should the owner
  die or hand the task on, the next acquire ends the lease revoked instead of
  running it again.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] stats hash
    KEYS[4] message hash of the task
    ARGV[1] task id
    ARGV[2] 1 when the message expired (Celery's expires), 0 for a revoke
    ARGV[3] retention in ms of the revoked record
    ARGV[4] owner (worker instance id) of the caller, '' when the caller holds no lease
    ARGV[5] token of the caller's lease, 0 when none: a caller that holds the
            live lease revokes its own execution (it is discarded or terminated)
    ARGV[6] task name, kept in a record created here

  Output: {code, token, state}, or {CORRUPT, key, field, detail}
    OK        the task is revoked (now, or it already was); with no record yet, a
              terminal revoked record is created
    FINISHED  the task already finished otherwise (succeeded, failed, dead): nothing changed
    BUSY      another owner holds a live lease and runs the task: nothing else
              changed; a plain revoke (not an expiry) was remembered
    CORRUPT   the record, the deadline index or the message is not what this
              protocol wrote; nothing written
]]
local key, deadlines, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local task_id, expired, retention = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local owner, token = ARGV[4], tonumber(ARGV[5])

local now = now_ms()
-- Everything this script depends on is read and validated before anything is written.
local rec, bad = load(key, {'state', 'token', 'owner'}, {'token'}, {'token'})
if bad then return bad end
local indexed = redis.pcall('ZSCORE', deadlines, task_id)
if wrong_type(indexed) then
  return corrupt(deadlines, 'type', 'is not a sorted set (' .. redis.call('TYPE', deadlines).ok .. ')')
end
bad = check_type(message, 'hash')
if bad then return bad end
local state = rec.state
local current = num(rec, key, 'token')

if not state then
  redis.call('HSET', key, 'task_id', task_id, 'state', 'revoked', 'token', 0, 'owner', '',
             'finished_at', now, 'name', ARGV[6])
  redis.call('PEXPIRE', key, retention)
  count(stats, 'revoked', 1)
  return {OK, 0, 'revoked'}
end
if state == 'revoked' then return {OK, current, state} end
if is_terminal(state) then return {FINISHED, current, state} end

local caller_holds = state == 'active' and token > 0 and current == token and rec.owner == owner
if state == 'active' and not caller_holds then
  local deadline = tonumber(indexed)
  if deadline and deadline > now then
    if not expired then redis.call('HSET', key, 'revoke_requested', now) end
    return {BUSY, current, state}
  end
end

end_lease(key, deadlines, message, task_id, 'revoked', now, retention)
count(stats, 'revoked', 1)
return {OK, current, 'revoked'}
