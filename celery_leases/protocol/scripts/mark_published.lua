--[[
  mark_published: confirm that a claimed lease's message was re-published
  (or, for a dead task, that its failure was stored).

  From then on the broker holds the task: the record leaves the deadline index
  and waits for the delivery that carries its generation. With publish tracking
  (ARGV[2] > 0) it waits in the queued index, due now, scored now + delivery
  timeout, its streak of undelivered re-publishes reset to 0 and its record and
  message kept without expiry: if the broker loses this copy too,
  claim_undelivered.lua re-publishes it. Without tracking it expires after the
  retention period. A dead task's message is dropped and its record expires.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2] queued index sorted set (written only with publish tracking)
    KEYS[2k+1], KEYS[2k+2] record hash and message hash of the kth lease (k = 1, 2, ...)
    ARGV[1] retention in ms
    ARGV[2] delivery timeout in ms; 0: publish tracking is off
    ARGV[2k+1], ARGV[2k+2] task id and generation of the pair KEYS[2k+1], KEYS[2k+2]

  Output: the number of records confirmed, an integer (a record acquired, finished,
  re-claimed or corrupted meanwhile is left alone and not counted), or
  {CORRUPT, key, field, detail}
    CORRUPT  the deadline index or (with tracking) the queued index is not a sorted set;
             nothing written
]]
local deadlines, queued = KEYS[1], KEYS[2]
local retention, timeout = tonumber(ARGV[1]), tonumber(ARGV[2]) or 0
local bad = check_type(deadlines, 'zset')
if not bad and timeout > 0 then bad = check_type(queued, 'zset') end
if bad then return bad end
local now = now_ms()
local confirmed = 0
for i = 1, (#KEYS - 2) / 2 do
  local key, message = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local task_id, generation = ARGV[2 * i + 1], ARGV[2 * i + 2]
  -- A record corrupted since it was claimed is left alone (and in the index, so the
  -- next claim_expired reports it); the rest of the batch is confirmed.
  local v = load(key, {'state', 'generation'}, {'generation'})
  if v and (v.state == 'recovering' or v.state == 'dead') and v.generation == generation then
    redis.call('ZREM', deadlines, task_id)
    if v.state == 'dead' then
      redis.call('DEL', message)
      redis.call('PEXPIRE', key, retention)
    elseif timeout > 0 then
      redis.call('HSET', key, 'due', now, 'undelivered_streak', 0)
      redis.call('ZADD', queued, now + timeout, task_id)
      redis.call('PERSIST', key)
      redis.call('PERSIST', message)
    else
      redis.call('PEXPIRE', message, retention)
      redis.call('PEXPIRE', key, retention)
    end
    confirmed = confirmed + 1
  end
end
return confirmed
