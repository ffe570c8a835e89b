--[[
  acquire: make the caller the owner of a task's lease, if it is the rightful owner.

  A delivery is the rightful owner when there is no record yet, when it is the
  recovered copy (its generation equals the record's while recovering), when it
  is a later retry attempt than the record's, or when the previous owner's lease
  has expired and no recovery has claimed it yet (a take-over, counted as a
  recovery only if its body had started, see mark_started.lua; an unstarted one
  is bounded by unstarted_limit). Older copies of the message are stale.

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
    ARGV[11] retention in ms of a record that turns dead here
    ARGV[12] 1 to draw the token no lower than the server clock in µs (sharded stores), 0 not to
    ARGV[13] optional: re-assert this token for the caller instead of drawing one. Only for
             an owner whose renewal found no record (a failover lost the write that
             created it): the record is re-created as it was, and refused (LOST) if
             any record exists that the caller does not hold

  Output: {code, token, generation, recoveries, state}
    ACQUIRED    the caller owns the lease with the new token
    TAKEN_OVER  the caller owns the lease; the previous owner had expired
    BUSY        a live owner holds the lease (token is theirs)
    FINISHED    the record is terminal (state says which)
    STALE       the message is an older copy than the record
    DEAD        taking over would pass max recoveries: the record is now dead
    LOST        (re-assert only) a record exists and the caller does not hold it
]]
local key, deadlines, seq, stats, message = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, owner = ARGV[1], ARGV[2]
local ttl = tonumber(ARGV[3])
local msg_gen, msg_attempt = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_recoveries = tonumber(ARGV[6])
local progress_timeout = tonumber(ARGV[7])

local now = now_ms()
local rec = read(key, 'state', 'token', 'generation', 'recoveries', 'attempt', 'hn', 'unstarted',
                 'started', 'unstarted_recoveries')
local state = rec.state
local token = num(rec, key, 'token')
local generation = num(rec, key, 'generation')
local recoveries = num(rec, key, 'recoveries')
local attempt = num(rec, key, 'attempt')
local unstarted_recoveries = num(rec, key, 'unstarted_recoveries')

local code = 1 -- ACQUIRED
local reassert = tonumber(ARGV[13] or '')
if reassert and reassert > 0 then
  if state then
    local held = redis.call('HGET', key, 'holder')
    if state == 'active' and held == string.format('%d', reassert) .. '@' .. owner then
      return {1, token, generation, recoveries, state}
    end
    return {7, token, generation, recoveries, state}
  end
  redis.call('HINCRBY', stats, 'reasserted', 1)
elseif state then
  if state == 'succeeded' or state == 'failed' or state == 'revoked' or state == 'dead' then
    return {4, token, generation, recoveries, state}
  elseif state ~= 'active' and state ~= 'recovering' then
    error({err = 'CORRUPT ' .. key .. ' field state is ' .. tostring(state)})
  end
  if msg_gen < generation or msg_attempt < attempt then
    redis.call('HINCRBY', stats, 'stale_deliveries', 1)
    return {5, token, generation, recoveries, state}
  end
  if state == 'active' and msg_attempt == attempt and msg_gen == generation then
    local deadline = tonumber(redis.call('ZSCORE', deadlines, task_id))
    if deadline and deadline > now then
      redis.call('HINCRBY', stats, 'busy_deliveries', 1)
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
      redis.call('HINCRBY', stats, 'dead', 1)
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
  local current = tonumber(redis.call('GET', seq) or '0') or 0
  if current < reassert then redis.call('SET', seq, string.format('%d', reassert)) end
else
  new_token = redis.call('INCR', seq)
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
redis.call('HSET', key, unpack(fields))
if ARGV[9] ~= '' then
  redis.call('HSET', message, 'body', ARGV[9], 'envelope', ARGV[10])
  redis.call('PERSIST', message)
end
redis.call('PERSIST', key)
redis.call('ZADD', deadlines, deadline, task_id)
redis.call('HINCRBY', stats, 'acquired', 1)
if code == 2 then redis.call('HINCRBY', stats, 'taken_over', 1) end
return {code, new_token, generation, recoveries, 'active'}
