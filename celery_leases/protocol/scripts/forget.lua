--[[
  forget: drop the record of a task whose publish failed (publish tracking), so that it does not run.

  A publish that raised tells the caller the task was not sent (Celery's
  apply_async raises); a record that enqueue.lua wrote just before must then not
  make recovery run it later (the caller may well publish it again under a new
  id). Only a record still queued and never re-published (generation 0) is
  dropped, with its message and index entry; any other record is left alone. If
  the message reached the broker after all, its delivery is leased at receipt,
  as a publish without tracking.

  Input:
    KEYS[1] record hash of the task
    KEYS[2] queued index sorted set
    KEYS[3] message hash of the task
    ARGV[1] task id

  Output: {code}, or {CORRUPT, key, field, detail}
    OK       the queued record, its message and index entry are gone
    MISSING  there is no record: nothing to do
    BUSY     the record is not queued, or was re-published: left as it is
    CORRUPT  the record is not what this protocol wrote; nothing written
]]
local key, index, message, task_id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local rec, bad = load(key, {'state', 'token', 'generation'}, {'token', 'generation'}, {'token'})
if bad then return bad end
if not rec.state then return {MISSING} end
if rec.state ~= 'queued' or num(rec, key, 'generation') ~= 0 then return {BUSY} end
bad = check_type(index, 'zset')
if bad then return bad end
redis.call('DEL', key, message)
redis.call('ZREM', index, task_id)
return {OK}
