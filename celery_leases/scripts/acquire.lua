--[[
  acquire: make the caller the owner of a task's lease, if it is the rightful owner.

  A delivery is the rightful owner when there is no record yet, when it is the
  recovered copy (its generation equals the record's while recovering), when it
  is a later retry attempt than the record's, or when the previous owner's lease
  has expired and no recovery has claimed it yet (a take-over, counted as a
  recovery only if its body had started, see mark_started.lua; an unstarted one
  is bounded by unstarted_limit). Older copies of the message are stale.
  A finished (succeeded or failed) record is run again by a new publish of the
  task id: a first attempt (generation 0, retries 0) whose publish id is neither
  the record's nor one of the earlier ones it remembers (the last 16, fields
  "p:0".."p:15"); a copy of a publish that already held the lease is refused as
  before (publish.py).
  A task revoked while an owner ran it (revoke.lua left revoke_requested) is never run
  again: the delivery that would have been the next owner ends the lease revoked.

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
    ARGV[9] message body ('' keeps the stored one)
    ARGV[10] message envelope, JSON ('' keeps the stored one)
    ARGV[11] retention in ms of a record that turns dead or revoked here
    ARGV[12] 1 to draw the token no lower than the server clock in µs (sharded stores), 0 not to
    ARGV[13] optional: re-assert this token for the caller instead of drawing one. Only for
             an owner whose renewal found no record (a failover lost the write that
             created it): the record is re-created as it was, and refused (LOST) if
             any record exists that the caller does not hold
    ARGV[14] optional: publish id carried by the message ('' when none)

  Output: {code, token, generation, recoveries, state}, or {CORRUPT, key, field, detail}
    ACQUIRED    the caller owns the lease with the new token
    TAKEN_OVER  the caller owns the lease; the previous owner had expired
    BUSY        a live owner holds the lease (token is theirs)
    FINISHED    the record is terminal (state says which) and the message is not a new
                publish, or was revoked while an owner ran it and is now terminal revoked
    STALE       the message is an older copy than the record, or a copy of an earlier publish
    DEAD        taking over would pass max recoveries: the record is now dead
    LOST        (re-assert only) a record exists and the caller does not hold it
    CORRUPT     the record, the deadline index, the token sequence or the message hash is
                not what this protocol wrote (checked before anything is written)
]]
local key, deadlines, seq, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner = ARGV[1], ARGV[2]
local ttl = tonumber(ARGV[3])
local msg_gen, msg_attempt = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_recoveries = tonumber(ARGV[6])
local progress_timeout = tonumber(ARGV[7])
if not (ttl and msg_gen and msg_attempt and max_recoveries and progress_timeout) then
  return redis.error_reply('ERR acquire: ttl, generation, attempt, max recoveries and progress '
                           .. 'timeout must be numbers (task ' .. task_id .. ')')
end

-- Everything this script depends on is read and validated before anything is written.
local PUBLISHES = 16 -- earlier publish ids remembered, one small field each (p:0..p:15, ring by pn)
local read = {'state', 'token', 'generation', 'recoveries', 'attempt', 'hn', 'unstarted', 'holder',
              'revoke_requested', 'started', 'unstarted_recoveries', 'pub', 'pn'}
for i = 0, PUBLISHES - 1 do read[#read + 1] = 'p:' .. i end
local rec, bad = load(key, read,
                      {'token', 'generation', 'recoveries', 'attempt', 'hn', 'revoke_requested',
                       'unstarted_recoveries', 'pn'}, {'token'})
if bad then return bad end
local pub = ARGV[14] or ''
-- A copy of a publish that held this lease before the current one: never run it again.
local function earlier_publish()
  if pub == '' then return false end
  for i = 0, PUBLISHES - 1 do
    if rec['p:' .. i] == pub then return true end
  end
  return false
end
-- The deadline read doubles as the index's type check.
local indexed = redis.pcall('ZSCORE', deadlines, task_id)
if wrong_type(indexed) then
  return corrupt(deadlines, 'type', 'is not a sorted set (' .. redis.call('TYPE', deadlines).ok .. ')')
end
bad = ARGV[9] ~= '' and check_type(message, 'hash') or nil
if bad then return bad end
local reassert = tonumber(ARGV[13] or '')
local sequence
if reassert and reassert > 0 then
  sequence = redis.pcall('GET', seq)
  if wrong_type(sequence) then
    return corrupt(seq, 'type', 'is not a string (' .. redis.call('TYPE', seq).ok .. ')')
  elseif sequence and not whole(sequence) then
    return corrupt(seq, 'value', 'is not a number: ' .. string.format('%q', sequence))
  end
end

local now = now_ms()
local state = rec.state
local token = num(rec, key, 'token')
local generation = num(rec, key, 'generation')
local recoveries = num(rec, key, 'recoveries')
local attempt = num(rec, key, 'attempt')
local unstarted_recoveries = num(rec, key, 'unstarted_recoveries')

local code = 1 -- ACQUIRED
if reassert and reassert > 0 then
  if state then
    if state == 'active' and rec.holder == string.format('%d', reassert) .. '@' .. owner then
      return {1, token, generation, recoveries, state}
    end
    return {7, token, generation, recoveries, state}
  end
  count(stats, 'reasserted', 1)
elseif state and earlier_publish() then
  count(stats, 'stale_deliveries', 1)
  return {5, token, generation, recoveries, state}
elseif state and (state == 'succeeded' or state == 'failed') and pub ~= '' and pub ~= (rec.pub or '')
    and msg_gen == 0 and msg_attempt == 0 and not rec.revoke_requested then
  -- (Only a first delivery of a first attempt: a retry's or a recovery's copy, however
  -- old, never starts a finished task again, even past the remembered publishes.)
  -- A new publish of a finished task id (a frozen signature applied again): a new run,
  -- as plain Celery runs it. Tokens and generation keep growing; the recovery budget
  -- starts again, since it is this run's.
  recoveries, unstarted_recoveries = 0, 0
  redis.call('HDEL', key, 'finished_at')
  count(stats, 'rerun', 1)
elseif state then
  if state == 'succeeded' or state == 'failed' or state == 'revoked' or state == 'dead' then
    return {4, token, generation, recoveries, state}
  end
  if msg_gen < generation or msg_attempt < attempt then
    count(stats, 'stale_deliveries', 1)
    return {5, token, generation, recoveries, state}
  end
  if rec.revoke_requested then
    -- Revoked while an owner ran it: that owner may still finish, nobody runs it again.
    local live = state == 'active' and msg_attempt == attempt and msg_gen == generation
      and (tonumber(indexed) or 0) > now
    if not live then
      redis.call('HSET', key, 'state', 'revoked', 'finished_at', now)
      redis.call('HDEL', key, 'holder')
      redis.call('DEL', message)
      redis.call('ZREM', deadlines, task_id)
      redis.call('PEXPIRE', key, tonumber(ARGV[11]))
      count(stats, 'revoked', 1)
      return {4, token, generation, recoveries, 'revoked'}
    end
  end
  if state == 'active' and msg_attempt == attempt and msg_gen == generation then
    local deadline = tonumber(indexed)
    if deadline and deadline > now then
      count(stats, 'busy_deliveries', 1)
      return {3, token, generation, recoveries, state}
    end
    -- The owner stopped renewing and no recovery has claimed the lease yet.
    -- As in claim_expired: only a lease whose body started counts a recovery.
    local unmarked = rec.unstarted ~= '1' and rec.started == '0'
    if unmarked then unstarted_recoveries = unstarted_recoveries + 1 end
    if rec.unstarted == '1' then
      code = 2
    elseif (unmarked and unstarted_recoveries > unstarted_limit(max_recoveries))
        or (not unmarked and recoveries >= max_recoveries) then
      redis.call('HSET', key, 'state', 'dead', 'finished_at', now, 'owner', '')
      redis.call('HDEL', key, 'holder')
      redis.call('DEL', message)
      redis.call('ZREM', deadlines, task_id)
      redis.call('PEXPIRE', key, tonumber(ARGV[11]))
      count(stats, 'dead', 1)
      return {6, token, generation, recoveries, 'dead'}
    elseif unmarked then
      code = 2
    else
      recoveries = recoveries + 1
      code = 2 -- TAKEN_OVER
    end
  end
end

local new_token
if reassert and reassert > 0 then
  -- The sequence may have lost increments along with the record: keep it at or above this token.
  new_token = reassert
  local current = tonumber(sequence or '0')
  if current < reassert then redis.call('SET', seq, string.format('%d', reassert)) end
else
  -- The first write of this path, so a sequence that is not a counter is answered
  -- before anything is written (INCR fails on a wrong type or a non-integer).
  new_token = redis.pcall('INCR', seq)
  if type(new_token) == 'table' and new_token.err then
    if string.find(new_token.err, 'WRONGTYPE', 1, true) then
      return corrupt(seq, 'type', 'is not a string (' .. redis.call('TYPE', seq).ok .. ')')
    elseif string.find(new_token.err, 'not an integer', 1, true) then
      return corrupt(seq, 'value', 'is not a counter: ' .. new_token.err)
    end
    return new_token -- READONLY (a failover), OOM, ...: the server's own error, nothing written
  end
  local floor = token + 1
  if ARGV[12] == '1' then
    -- Each shard has its own sequence: tokens of different shards are ordered by
    -- the masters' clocks instead (now in µs stays exact below 2^53 in Lua).
    floor = math.max(floor, now * 1000)
  end
  if new_token < floor then
    new_token = floor
    redis.call('SET', seq, string.format('%d', new_token))
  end
end
if msg_gen > generation then generation = msg_gen end

-- Not started until the worker says so (mark_started.lua): a prefetched task
-- waits here. A re-asserted lease was already running.
local started = '0'
if reassert and reassert > 0 then started = '1' end
local tok = string.format('%d', new_token)
local deadline = now + ttl
local progress_deadline = 0
if progress_timeout > 0 then progress_deadline = now + progress_timeout end
local fields = {
  'task_id', task_id, 'state', 'active', 'token', tok, 'owner', owner,
  'holder', tok .. '@' .. owner, 'ttl', ttl, 'generation', generation,
  'recoveries', recoveries, 'attempt', msg_attempt,
  'progress_timeout', progress_timeout, 'progress_deadline', progress_deadline,
  'acquired_at', now, 'name', ARGV[8], 'unstarted', '0', 'max_recoveries', max_recoveries,
  'started', started, 'unstarted_recoveries', unstarted_recoveries,
  history_fields(key, num(rec, key, 'hn'), tok .. '@' .. owner .. '@' .. string.format('%d', now))}
if not (reassert and reassert > 0) then
  -- The publish this delivery belongs to; the one before it joins the remembered ones.
  fields[#fields + 1] = 'pub'
  fields[#fields + 1] = pub
  if rec.pub and rec.pub ~= '' and rec.pub ~= pub then
    local pn = num(rec, key, 'pn')
    fields[#fields + 1] = 'p:' .. (pn % PUBLISHES)
    fields[#fields + 1] = rec.pub
    fields[#fields + 1] = 'pn'
    fields[#fields + 1] = pn + 1
  end
end
redis.call('HSET', key, unpack(fields))
if ARGV[9] ~= '' then
  redis.call('HSET', message, 'body', ARGV[9], 'envelope', ARGV[10])
  redis.call('PERSIST', message)
end
redis.call('PERSIST', key)
redis.call('ZADD', deadlines, deadline, task_id)
count(stats, 'acquired', 1)
if code == 2 then count(stats, 'taken_over', 1) end
return {code, new_token, generation, recoveries, 'active'}
