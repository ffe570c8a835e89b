--[[
  acquire: make the caller the owner of a task's lease, if it is the rightful owner.

  A delivery is the rightful owner when there is no record yet, when it is the
  recovered copy (its generation equals the record's while recovering), when it
  is a later retry attempt than the record's, or when the previous owner's lease
  has expired and no recovery has claimed it yet (a take-over, charged to the
  task by charge_death's rule, as a recovery pass would). Older copies of the
  message are stale. A task whose blame was uncertain for two earlier deaths
  (field isolate) is answered with isolate 1: its owner runs it alone and marks
  its start before the body (mark_started.lua, alone), so its next death is
  charged exactly.
  A finished (succeeded or failed) record is run again by a new publish of the
  task id: a first attempt (generation 0, retries 0) whose publish id is neither
  the record's nor one of the earlier ones it remembers (the last 16, fields
  "p:0".."p:15"); a copy of a publish that already held the lease is refused
  (FINISHED, or STALE; publish.py).
  A task revoked while an owner ran it (revoke.lua left revoke_requested) is never run
  again: the delivery that would have been the next owner ends the lease revoked.
  (An owner whose record vanished re-creates it with reassert.lua, not here.)

  Input:
    KEYS[1] record hash of the task
    KEYS[2] deadlines sorted set
    KEYS[3] token sequence counter
    KEYS[4] stats hash
    KEYS[5] message hash of the task (body, envelope, pub: the publish id it belongs to)
    KEYS[6] optional: queued index sorted set; a record queued at publish (enqueue.lua)
            is acquired like a fresh one and leaves this index, as does a recovering one
            (waiting there with publish tracking: mark_published.lua, hand_over.lua)
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
    ARGV[13] optional: publish id carried by the message ('' when none)
    ARGV[14] optional: '1' when the caller left the message out (ARGV[9] and ARGV[10] '')
            because its publisher recorded it (enqueue.lua): the stored message is kept if it
            is this publish's (its pub is ARGV[13]); otherwise NO_MESSAGE, nothing written
    ARGV[15] optional: '1' when the owner's pool runs several tasks in one process (threads,
            gevent, eventlet): a death there is not the task's own unless it ran alone

  Output: {code, token, generation, recoveries, state, isolate} when the caller owns the lease
  (isolate 1: run it alone, marked started before its body), {code, token, generation,
  recoveries, state} otherwise, or {CORRUPT, key, field, detail}
    ACQUIRED    the caller owns the lease with the new token
    TAKEN_OVER  the caller owns the lease; the previous owner had expired
    BUSY        a live owner holds the lease (token is theirs)
    FINISHED    the record is terminal (state says which) and the message is not a new
                publish, or was revoked while an owner ran it and is now terminal revoked
    STALE       the message is an older copy than the record, or a copy of an earlier publish
    DEAD        taking over would pass max recoveries: the record is now dead
    NO_MESSAGE  the message was left out (ARGV[14]) and the store does not hold this publish's
                message: nothing written; the caller sends the acquire again with it
    CORRUPT     the record, the deadline index, the token sequence or the message hash is
                not what this protocol wrote (checked before anything is written)
]]
local key, deadlines, seq, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner = ARGV[1], ARGV[2]
local ttl = tonumber(ARGV[3])
local msg_gen, msg_attempt = whole(ARGV[4]), whole(ARGV[5])
local max_recoveries = tonumber(ARGV[6])
local progress_timeout = whole(ARGV[7])
if not (ttl and msg_gen and msg_attempt and max_recoveries and progress_timeout) then
  return redis.error_reply('ERR acquire: ttl, generation, attempt, max recoveries and progress '
                           .. 'timeout must be numbers (task ' .. task_id .. ')')
end

-- Everything this script depends on is read and validated before anything is written.
local PUBLISHES = 16 -- earlier publish ids remembered, one small field each (p:0..p:15, ring by pn)
-- A record queued at publish (enqueue.lua) or absent holds no field of an earlier run: the
-- fields only such a run leaves (the start marks, the blame, revoke requests, the remembered
-- publishes) are read only for a record in another state, in a second read.
local rec, bad = load(key, {'state', 'token', 'generation', 'recoveries', 'attempt', 'hn', 'pub'},
                      {'token', 'generation', 'recoveries', 'attempt', 'hn'}, {'token'})
if bad then return bad end
local ran = rec.state and rec.state ~= 'queued'
if ran then
  local more
  more, bad = load(key, {'unstarted', 'revoke_requested', 'started', 'unstarted_recoveries', 'pn',
                         'shared', 'alone', 'isolate', 'waited_deaths'},
                   {'revoke_requested', 'unstarted_recoveries', 'pn', 'waited_deaths'})
  if bad then return bad end
  for field, value in pairs(more) do rec[field] = value end
end
local pub = ARGV[13] or ''
local omitted = ARGV[14] == '1'
local shared = ARGV[15] == '1'
-- A copy of a publish that held this lease before the current one: never run it again.
-- (The remembered ids are read only when the record has some: pn counts those written, in
-- p:0.. up to PUBLISHES, so most acquires read 13 fields, not 29.)
local function earlier_publish()
  if pub == '' then return false end
  local n = math.min(tonumber(rec.pn) or 0, PUBLISHES)
  if n == 0 then return false end
  local names = {}
  for i = 0, n - 1 do names[#names + 1] = 'p:' .. i end
  for _, id in ipairs(redis.call('HMGET', key, unpack(names))) do
    if id == pub then return true end
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

-- A task recorded at publish (enqueue.lua): acquired like a fresh record, out of the queued index;
-- a recovering one may wait there too (a confirmed re-publish, a retry hand-over, with tracking).
local queued = (rec.state == 'queued' or rec.state == 'recovering') and KEYS[6]
if queued then
  bad = check_type(KEYS[6], 'zset')
  if bad then return bad end
end

local now = now_ms()
local state = rec.state
local token = num(rec, key, 'token')
local generation = num(rec, key, 'generation')
local recoveries = num(rec, key, 'recoveries')
local attempt = num(rec, key, 'attempt')
local unstarted_recoveries = num(rec, key, 'unstarted_recoveries')
local isolate = rec.isolate == '1'
local waited  -- a waited death's new count (charge_death), written with the lease

-- A message left out by its caller: the one recorded at publish must be this publish's.
-- (Asked before any decision writes; a delivery that would be refused is refused on its
-- second call, with the message.)
if omitted then
  local stored = redis.pcall('HGET', message, 'pub')
  if wrong_type(stored) then
    return corrupt(message, 'type', 'is not a hash (' .. redis.call('TYPE', message).ok .. ')')
  end
  if pub == '' or stored ~= pub then
    return {NO_MESSAGE, token, generation, recoveries, state or ''}
  end
end

local code = ACQUIRED
if state and earlier_publish() then
  count(stats, 'stale_deliveries', 1)
  return {STALE, token, generation, recoveries, state}
elseif state and (state == 'succeeded' or state == 'failed') and pub ~= '' and pub ~= (rec.pub or '')
    and msg_gen == 0 and msg_attempt == 0 and not rec.revoke_requested then
  -- (Only a first delivery of a first attempt: a retry's or a recovery's copy, however
  -- old, never starts a finished task again, even past the remembered publishes.)
  -- A new publish of a finished task id (a frozen signature applied again): a new run,
  -- as plain Celery runs it. Tokens and generation keep growing; the recovery budget
  -- starts again, since it is this run's.
  recoveries, unstarted_recoveries, isolate = 0, 0, false
  redis.call('HDEL', key, 'finished_at', 'isolate', 'waited_deaths')
  count(stats, 'rerun', 1)
elseif state then
  if is_terminal(state) then
    count(stats, 'finished_deliveries', 1)
    return {FINISHED, token, generation, recoveries, state}
  end
  if msg_gen < generation or msg_attempt < attempt then
    count(stats, 'stale_deliveries', 1)
    return {STALE, token, generation, recoveries, state}
  end
  if rec.revoke_requested then
    -- Revoked while an owner ran it: that owner may still finish, nobody runs it again.
    local live = state == 'active' and msg_attempt == attempt and msg_gen == generation
      and (tonumber(indexed) or 0) > now
    if not live then
      end_lease(key, deadlines, message, task_id, 'revoked', now, tonumber(ARGV[11]))
      count(stats, 'revoked', 1)
      return {FINISHED, token, generation, recoveries, 'revoked'}
    end
  end
  if state == 'active' and msg_attempt == attempt and msg_gen == generation then
    local deadline = tonumber(indexed)
    if deadline and deadline > now then
      count(stats, 'busy_deliveries', 1)
      return {BUSY, token, generation, recoveries, state}
    end
    -- The owner stopped renewing and no recovery has claimed the lease yet: charged as a
    -- recovery pass would (the record's own bound, as it is this task's).
    local _, counted, uncertain, is_dead, isolates
    _, counted, uncertain, is_dead, isolates, waited = charge_death(rec, key, max_recoveries)
    if is_dead then
      end_lease(key, deadlines, message, task_id, 'dead', now, tonumber(ARGV[11]), 'owner', '',
                'unstarted_recoveries', uncertain, 'waited_deaths', waited or 0)
      count(stats, 'dead', 1)
      return {DEAD, token, generation, recoveries, 'dead'}
    end
    recoveries, unstarted_recoveries = counted, uncertain
    if isolates then isolate = true end
    code = TAKEN_OVER
  end
end

-- The first write of this path, so a sequence that is not a counter is answered
-- before anything is written (INCR fails on a wrong type or a non-integer).
local new_token = redis.pcall('INCR', seq)
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
-- (What the record already holds is not written again: activate.)
local same_counts = state == 'queued' and msg_gen <= generation and msg_attempt == attempt
if msg_gen > generation then generation = msg_gen end

-- The publish this delivery belongs to; the one before it joins the remembered ones.
local extra = {'pub', pub}
if shared then
  extra[3], extra[4], extra[5], extra[6] = 'shared', '1', 'alone', '0'
elseif rec.shared == '1' then
  extra[3], extra[4] = 'shared', '0'
end
if isolate and rec.isolate ~= '1' then extra[#extra + 1] = 'isolate'; extra[#extra + 1] = '1' end
if waited then extra[#extra + 1] = 'waited_deaths'; extra[#extra + 1] = waited end
if rec.pub and rec.pub ~= '' and rec.pub ~= pub then
  local pn = num(rec, key, 'pn')
  local n = #extra
  extra[n + 1], extra[n + 2], extra[n + 3], extra[n + 4] = 'p:' .. (pn % PUBLISHES), rec.pub, 'pn', pn + 1
end
-- Not started until the worker says so (mark_started.lua): a prefetched task waits here.
activate(key, deadlines, stats, message, {
  task_id = task_id, owner = owner, token = new_token, now = now, ttl = ttl,
  generation = generation, recoveries = recoveries, attempt = msg_attempt,
  progress_timeout = progress_timeout, name = ARGV[8], max_recoveries = max_recoveries,
  started = '0', unstarted_recoveries = unstarted_recoveries, hn = num(rec, key, 'hn'),
  body = ARGV[9], envelope = ARGV[10], pub = pub,
  -- Only a recovering or finished record has an expiry to drop (mark_published, end_lease).
  persist = state ~= nil and state ~= false and state ~= 'queued',
  persist_message = omitted and state ~= 'queued',
  -- Fields of an earlier run to overwrite, only if there was one.
  ran = ran, queued = state == 'queued', same_counts = same_counts}, extra)
if code == TAKEN_OVER then count(stats, 'taken_over', 1) end
if queued then redis.call('ZREM', KEYS[6], task_id) end
return {code, new_token, generation, recoveries, 'active', isolate and 1 or 0}
