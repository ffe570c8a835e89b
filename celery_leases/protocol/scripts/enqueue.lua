--[[
  enqueue: record a task at publish as queued, so that a message the broker loses is re-published.

  Called before the message is published (tracking.py), so a publisher that dies
  between the two leaves a record without a message: claim_undelivered.lua
  re-publishes it once the delivery timeout has passed. Only a task id that has
  no record is recorded. An existing record is never overwritten, whatever its
  state: a retry or replace (active or recovering), a second publish of an id
  still queued, or a new publish of a finished id; nothing is written then, the
  message is published all the same and acquire.lua decides at receipt, exactly
  as for a publish without tracking.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] queued index sorted set (task id -> due + delivery timeout, ms)
    KEYS[3] message hash of the task (body, envelope, pub)
    KEYS[4] stats hash
    ARGV[1] task id
    ARGV[2] task name
    ARGV[3] message body (the serialized bytes as published)
    ARGV[4] message envelope, JSON (routing, headers, properties, content type and encoding)
    ARGV[5] delivery timeout in ms (> 0)
    ARGV[6] ETA in ms since the epoch, 0 when none: the task is due then, not at publish
    ARGV[7] expires in ms since the epoch, 0 when none
    ARGV[8] optional: the message's publish id ('' when none), kept with the message so an
            acquire of this publish may leave the message out (acquire.lua ARGV[14])
    KEYS[5] optional: the broker's queue list the message goes to (the lease store and the
            broker share a server and database): the message is pushed there in this call,
            after the record and whatever the record's answer, so record and publish are one
            atomic step (tracking's one-call publish)
    ARGV[9] optional, with KEYS[5]: the message as kombu's Redis transport pushes it (JSON)

  Output: {code, state}, or {CORRUPT, key, field, detail}
    OK        recorded: state queued, generation 0, indexed at due + delivery timeout
    BUSY      a record exists and is not terminal (queued, active, recovering): nothing written
    FINISHED  a terminal record exists (succeeded, failed, dead, revoked): nothing written
    CORRUPT   the record, the queued index or the message hash is not what this protocol
              wrote (checked before anything is written)
  With KEYS[5] the message is pushed in every case above; a record that fails half-way (a
  server error) is answered as that error, the message pushed all the same.
]]
local key, index, message, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local task_id, name = ARGV[1], ARGV[2]
local timeout, eta, expires = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])

local function record()
  if not (timeout and timeout > 0 and eta and expires) then
    return redis.error_reply('ERR enqueue: delivery timeout, eta and expires must be numbers '
                             .. '(task ' .. task_id .. ')')
  end
  local rec, bad = load(key, {'state', 'token'}, {'token'}, {'token'})
  if bad then return bad end
  if rec.state then
    if is_terminal(rec.state) then return {FINISHED, rec.state} end
    return {BUSY, rec.state}
  end
  bad = check_type(index, 'zset') or check_type(message, 'hash')
  if bad then return bad end
  local now = now_ms()
  local due = math.max(now, eta)
  -- (No owner, generation, recoveries or attempt: absent, each reads as 0 and no owner,
  -- and every field costs the write its time. The token is written: a record's mark.)
  redis.call('HSET', key, 'task_id', task_id, 'state', 'queued', 'token', 0, 'name', name,
             'published_at', now, 'due', due, 'expires', expires)
  redis.call('HSET', message, 'body', ARGV[3], 'envelope', ARGV[4], 'pub', ARGV[8] or '')
  redis.call('ZADD', index, due + timeout, task_id)
  count(stats, 'queued', 1)
  return {OK, 'queued'}
end

if not KEYS[5] then return record() end
-- One-call publish: the message goes out whatever the record's answer (tracking never stops
-- a publish), after the record, so no worker can receive it before it is recorded.
local ok, reply = pcall(record)
redis.call('LPUSH', KEYS[5], ARGV[9])
if not ok then
  if type(reply) == 'table' and reply.err then return redis.error_reply(reply.err) end
  return redis.error_reply('ERR enqueue of task ' .. task_id .. ' failed: ' .. tostring(reply))
end
return reply
