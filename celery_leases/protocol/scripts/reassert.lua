--[[
  reassert: re-create the lease record of an owner whose record vanished, under its own token.

  Only for an owner whose renewal found no record (a failover lost the write
  that created it, the store restarted empty): the record is written active
  with the caller's token, as acquire.lua would have written it, and the token
  sequence is raised to that token so no later acquire hands it out again. The
  caller's lease was already running, so it is marked started. Refused (LOST)
  when any record exists that the caller does not hold; answered ACQUIRED and
  nothing changed when the caller holds the record already (an earlier copy of
  this call).

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] token sequence counter
    KEYS[4] stats hash
    KEYS[5] message hash of the task (body, envelope)
    ARGV[1] task id
    ARGV[2] owner (worker instance id)
    ARGV[3] ttl in ms
    ARGV[4] generation carried by the message (0 when none)
    ARGV[5] attempt carried by the message (Celery's retries)
    ARGV[6] max recoveries of this task (kept in the record for recovery passes)
    ARGV[7] progress timeout in ms (0: off)
    ARGV[8] task name
    ARGV[9] message body ('' stores none)
    ARGV[10] message envelope, JSON ('' with no body)
    ARGV[11] the caller's token, re-asserted

  Output: {code, token, generation, recoveries, state}, or {CORRUPT, key, field, detail}
    ACQUIRED  the record is (again) the caller's, with its token
    LOST      a record exists and the caller does not hold it
    CORRUPT   the record, the deadline index, the token sequence or the message hash is
              not what this protocol wrote (checked before anything is written)
]]
local key, deadlines, seq, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner = ARGV[1], ARGV[2]
local ttl, msg_gen, msg_attempt = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local max_recoveries, progress_timeout = tonumber(ARGV[6]), tonumber(ARGV[7])
local token = tonumber(ARGV[11])
if not (ttl and msg_gen and msg_attempt and max_recoveries and progress_timeout and token and token > 0) then
  return redis.error_reply('ERR reassert: ttl, generation, attempt, max recoveries, progress '
                           .. 'timeout and token must be numbers (task ' .. task_id .. ')')
end

-- Everything this script depends on is read and validated before anything is written.
local rec, bad = load(key, {'state', 'token', 'generation', 'recoveries', 'holder'},
                      {'token', 'generation', 'recoveries'}, {'token'})
if bad then return bad end
local indexed = redis.pcall('ZSCORE', deadlines, task_id)
if wrong_type(indexed) then
  return corrupt(deadlines, 'type', 'is not a sorted set (' .. redis.call('TYPE', deadlines).ok .. ')')
end
bad = ARGV[9] ~= '' and check_type(message, 'hash') or nil
if bad then return bad end
local sequence = redis.pcall('GET', seq)
if wrong_type(sequence) then
  return corrupt(seq, 'type', 'is not a string (' .. redis.call('TYPE', seq).ok .. ')')
elseif sequence and not whole(sequence) then
  return corrupt(seq, 'value', 'is not a number: ' .. string.format('%q', sequence))
end

if rec.state then
  local current = num(rec, key, 'token')
  local generation, recoveries = num(rec, key, 'generation'), num(rec, key, 'recoveries')
  if rec.state == 'active' and rec.holder == string.format('%d', token) .. '@' .. owner then
    return {ACQUIRED, current, generation, recoveries, rec.state}
  end
  return {LOST, current, generation, recoveries, rec.state}
end

local now = now_ms()
-- The sequence may have lost increments along with the record: keep it at or above this token.
keep_token(seq, stats, token)
activate(key, deadlines, stats, message, {
  task_id = task_id, owner = owner, token = token, now = now, ttl = ttl,
  generation = msg_gen, recoveries = 0, attempt = msg_attempt,
  progress_timeout = progress_timeout, name = ARGV[8], max_recoveries = max_recoveries,
  started = '1', unstarted_recoveries = 0, hn = 0, body = ARGV[9], envelope = ARGV[10], ran = true})
return {ACQUIRED, token, msg_gen, 0, 'active'}
