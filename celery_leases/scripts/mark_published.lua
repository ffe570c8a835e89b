--[[
  mark_published: confirm that a claimed lease's message was re-published
  (or, for a dead task, that its failure was stored).

  From then on the broker holds the task: the record leaves the deadline index
  and waits (for the retention period at most) for the delivery that carries
  its generation.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2..n] record hash and message hash of each lease, in pairs, in the order below
    ARGV[1] retention in ms
    ARGV[2k], ARGV[2k+1] task id and generation of the pair KEYS[2k], KEYS[2k+1]

  Output: number of records confirmed (OK for each; a record acquired, finished,
  re-claimed or corrupted meanwhile is left alone), or {CORRUPT, key, field, detail}
    CORRUPT  the deadline index is not a sorted set; nothing written
]]
local deadlines, retention = KEYS[1], tonumber(ARGV[1])
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local confirmed = 0
for i = 1, (#KEYS - 1) / 2 do
  local key, message = KEYS[2 * i], KEYS[2 * i + 1]
  local task_id, generation = ARGV[2 * i], ARGV[2 * i + 1]
  -- A record corrupted since it was claimed is left alone (and in the index, so the
  -- next claim_expired reports it); the rest of the batch is confirmed.
  local v = load(key, {'state', 'generation'}, {'generation'})
  if v and (v.state == 'recovering' or v.state == 'dead') and v.generation == generation then
    redis.call('ZREM', deadlines, task_id)
    if v.state == 'dead' then
      redis.call('DEL', message)
    else
      redis.call('PEXPIRE', message, retention)
    end
    redis.call('PEXPIRE', key, retention)
    confirmed = confirmed + 1
  end
end
return confirmed
