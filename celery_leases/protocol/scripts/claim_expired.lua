--[[
  claim_expired: claim leases whose deadline passed, for re-publishing.

  Safe to run concurrently: a lease renewed, finished or claimed by another
  recoverer since the caller listed it is skipped. A claim bumps the
  generation (older copies of the message become stale) and gives the
  recoverer a grace period to publish; if it never confirms (mark_published),
  the next pass claims the lease again without counting another recovery.
  What the dead owner's lease costs its task is charge_death's rule
  (_helpers.lua): a recovery when the death is the task's own, an uncertain one
  (bounded by unstarted_limit) when it may not be, and from the second of those
  the task's next runs are isolated (field isolate, answered by acquire); nothing
  for a lease released unstarted, nor for an isolated task that died unmarked
  (a waited death, counted in waited_deaths, bounded by waited_limit). Past any
  bound the task becomes dead instead.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2] stats hash
    KEYS[3..n] record hash and message hash of each candidate, in pairs, in the order of the ids below
    ARGV[1] max recoveries of records that do not carry their own
    ARGV[2] publish grace in ms
    ARGV[3..] task id of each pair (ARGV[2+i] for KEYS[1+2i], KEYS[2+2i])

  Output: list of {task id, code, generation, recoveries, name, body, envelope},
  or {CORRUPT, key, field, detail} when the deadline index is not a sorted set
    RECOVERED  claimed: publish body/envelope with this generation, then mark_published
    DEAD       past max recoveries (or the uncertain or waited bound: recoveries then
               counts those deaths too): the record is now dead. The caller stores the failure
               (and may dead-letter the body), then confirms with mark_published; an
               unconfirmed dead record is handed out again after the publish grace
    CORRUPT    the record or its message hash is not what this protocol wrote: the row is
               {task id, CORRUPT, key, "field detail", name, body, envelope} (body and
               envelope when readable); the record is not touched, its id leaves the index
]]
local deadlines, stats = KEYS[1], KEYS[2]
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local max_recoveries, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local out = {}
local recovered, dead = 0, 0
local fields = {'state', 'generation', 'recoveries', 'name', 'unstarted', 'max_recoveries', 'token',
                'started', 'unstarted_recoveries', 'shared', 'alone', 'isolate', 'waited_deaths'}
local numeric = {'generation', 'recoveries', 'max_recoveries', 'token', 'unstarted_recoveries',
                 'waited_deaths'}

for i = 1, (#KEYS - 2) / 2 do
  local key, message, task_id = KEYS[1 + 2 * i], KEYS[2 + 2 * i], ARGV[2 + i]
  local deadline = tonumber(redis.call('ZSCORE', deadlines, task_id))
  local rec, bad_record = load(key, fields, numeric, {'token'})
  if not bad_record then bad_record = check_type(message, 'hash') end
  if bad_record and not (deadline and deadline <= now) then
    -- Not due (renewed since it was listed, or not indexed): nothing to claim yet.
  elseif bad_record then
    -- One corrupt record affects its task alone: it leaves the index (so it is not
    -- claimed on every pass) and is reported with its message, if readable, to be parked.
    -- The record itself is left as it is, for an operator to inspect.
    if deadline then redis.call('ZREM', deadlines, task_id) end
    local body = redis.pcall('HMGET', message, 'body', 'envelope')
    if wrong_type(body) then body = {} end
    local name = redis.pcall('HGET', key, 'name')
    if type(name) ~= 'string' then name = '' end
    table.insert(out, {task_id, CORRUPT, bad_record[2], bad_record[3] .. ' ' .. bad_record[4],
                       name, body[1] or '', body[2] or ''})
  else
    local state = rec.state
    if state == 'dead' and deadline and deadline <= now then
      -- Declared dead by an earlier pass whose notice (LeaseExpired stored,
      -- waiters released) was never confirmed: hand it out again.
      local body = redis.call('HMGET', message, 'body', 'envelope')
      redis.call('ZADD', deadlines, now + grace, task_id)
      table.insert(out, {task_id, DEAD, num(rec, key, 'generation'), num(rec, key, 'recoveries'),
                         rec.name or '', body[1] or '', body[2] or ''})
    elseif state ~= 'active' and state ~= 'recovering' then
      -- Finished, expired or missing: the index entry is left over.
      if deadline then redis.call('ZREM', deadlines, task_id) end
    elseif deadline and deadline <= now then
      local generation = num(rec, key, 'generation') + 1
      local body = redis.call('HMGET', message, 'body', 'envelope')
      local limit = max_recoveries
      if rec.max_recoveries then limit = num(rec, key, 'max_recoveries') end
      -- A recovering lease claimed again (its re-publish never confirmed) costs nothing more.
      local charge, recoveries, uncertain, is_dead, isolates, waited = 'released',
        num(rec, key, 'recoveries'), num(rec, key, 'unstarted_recoveries'), false, false, nil
      if state == 'active' then
        charge, recoveries, uncertain, is_dead, isolates, waited = charge_death(rec, key, limit)
      end
      if is_dead then
        -- Dead; the message stays until the caller confirms its notice
        -- (mark_published), and the index entry brings it back if it never does.
        redis.call('HSET', key, 'state', 'dead', 'owner', '', 'finished_at', now,
                   'unstarted_recoveries', uncertain, 'waited_deaths', waited or 0)
        redis.call('HDEL', key, 'holder')
        redis.call('ZADD', deadlines, now + grace, task_id)
        dead = dead + 1
        -- Past the uncertain or waited bound, report every abandonment (LeaseExpired names
        -- the count).
        local abandoned = recoveries
        if charge == 'uncertain' then abandoned = recoveries + uncertain end
        if charge == 'waited' then abandoned = recoveries + uncertain + waited end
        table.insert(out, {task_id, DEAD, generation - 1, abandoned, rec.name or '', body[1] or '', body[2] or ''})
      else
        local fields = {'state', 'recovering', 'owner', '', 'generation', generation,
                        'recoveries', recoveries, 'attempt', 0, 'unstarted_recoveries', uncertain}
        if isolates then
          fields[#fields + 1] = 'isolate'; fields[#fields + 1] = '1'
        end
        if waited then
          fields[#fields + 1] = 'waited_deaths'; fields[#fields + 1] = waited
        end
        redis.call('HSET', key, unpack(fields))
        redis.call('HDEL', key, 'holder')
        redis.call('ZADD', deadlines, now + grace, task_id)
        recovered = recovered + 1
        table.insert(out, {task_id, RECOVERED, generation, recoveries, rec.name or '', body[1] or '', body[2] or ''})
      end
    end
  end
end
if recovered > 0 then count(stats, 'recovered', recovered) end
if dead > 0 then count(stats, 'dead', dead) end
return out
