--[[
  claim_undelivered: claim tasks waiting for a delivery that no worker acquired within the delivery timeout.

  Two kinds of record wait in the queued index for a worker to acquire them: a
  task recorded at publish (queued, enqueue.lua), and a task whose copy the
  broker now holds for it with no owner (recovering: a re-publish confirmed by
  mark_published.lua, a retry handed over by hand_over.lua). For each listed
  task still waiting and overdue (its score passed, by the server clock): past
  its expires, it becomes revoked (reason expired) and leaves the index;
  otherwise its generation grows by one, attempt is reset to 0 (the
  re-published message carries its own retry count), and the caller
  re-publishes it under the same id with the new generation. The late copy, if
  it was only late, then carries an older generation and acquire.lua refuses it
  as stale. Its next re-publish waits longer each time it stays undelivered:
  the nth consecutive one (undelivered_streak, reset when a worker hands the task to
  the broker again) is due timeout * 2^(n-1) after now, at most ARGV[3] times
  the timeout, so at most one re-published copy is outstanding per wait and a
  task behind a deep backlog gets a logarithmic number of copies, then one per
  cap. Recoveries are not counted: waiting is never a reason to die. A listed
  id in any other state (acquired, finished) only leaves the index.

  Input:
    KEYS[1] queued index sorted set
    KEYS[2] stats hash
    KEYS[3..] pairs: record hash, message hash of each task id, in ARGV order
    ARGV[1] delivery timeout in ms (the first re-publish waits this long after now)
    ARGV[2] retention in ms of a record that turns revoked (expired)
    ARGV[3] the longest wait between re-publishes, as a multiple of the delivery timeout (>= 1)
    ARGV[4..] task ids

  Output: a list of rows {task id, code, generation, name, body, envelope, detail},
          or {CORRUPT, key, field, detail} when the queued index is not a sorted set
    RECOVERED  re-publish the message with this generation
    FINISHED   past its expires: the record is now revoked; store Celery's revoked state (expired), do not re-publish
    CORRUPT    (a row; detail names key and field) the record or its message is not what
               this protocol wrote: it leaves the index, the record is left as it is
]]
local index, stats = KEYS[1], KEYS[2]
local timeout, retention, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if not (timeout and timeout > 0 and retention and cap and cap >= 1) then
  return redis.error_reply('ERR claim_undelivered: delivery timeout, retention and backoff cap '
                           .. 'must be numbers (timeout > 0, cap >= 1)')
end
local bad = check_type(index, 'zset')
if bad then return bad end
local now = now_ms()
local out = {}
local republished, expired = 0, 0
local WAITING = {queued = true, recovering = true}
for i = 4, #ARGV do
  local task_id = ARGV[i]
  local key, message = KEYS[2 * (i - 4) + 3], KEYS[2 * (i - 4) + 4]
  local score = tonumber(redis.call('ZSCORE', index, task_id))
  local rec, bad_record = load(key, {'state', 'token', 'generation', 'expires', 'name', 'undelivered_streak'},
                               {'token', 'generation', 'expires', 'undelivered_streak'}, {'token'})
  if not bad_record then bad_record = check_type(message, 'hash') end
  if not score or score > now then
    -- Not overdue (acquired or re-scored since it was listed): nothing to claim.
  elseif bad_record then
    redis.call('ZREM', index, task_id)
    table.insert(out, {task_id, CORRUPT, 0, '', '', '', bad_record[2] .. ' ' .. bad_record[3] .. ' ' .. bad_record[4]})
  elseif not WAITING[rec.state] then
    redis.call('ZREM', index, task_id)
  else
    local body = redis.call('HMGET', message, 'body', 'envelope')
    local generation = num(rec, key, 'generation')
    local expires = num(rec, key, 'expires')
    if expires > 0 and expires <= now then
      redis.call('HSET', key, 'state', 'revoked', 'finished_at', now, 'revoked_reason', 'expired')
      redis.call('DEL', message)
      redis.call('ZREM', index, task_id)
      redis.call('PEXPIRE', key, retention)
      expired = expired + 1
      table.insert(out, {task_id, FINISHED, generation, rec.name or '', body[1] or '', body[2] or '', ''})
    elseif not body[1] then
      redis.call('ZREM', index, task_id)
      table.insert(out, {task_id, CORRUPT, 0, '', '', '', message .. ' body is missing'})
    else
      generation = generation + 1
      local streak = num(rec, key, 'undelivered_streak') + 1
      local wait = cap
      if streak <= 31 then wait = math.min(cap, 2 ^ (streak - 1)) end
      redis.call('HSET', key, 'generation', generation, 'due', now, 'attempt', 0,
                 'undelivered_streak', streak)
      redis.call('HINCRBY', key, 'republished', 1)
      redis.call('ZADD', index, now + math.floor(timeout * wait), task_id)
      republished = republished + 1
      table.insert(out, {task_id, RECOVERED, generation, rec.name or '', body[1], body[2] or '', ''})
    end
  end
end
if republished > 0 then count(stats, 'undelivered_republished', republished) end
if expired > 0 then
  count(stats, 'undelivered_expired', expired)
  count(stats, 'revoked', expired)
end
return out
