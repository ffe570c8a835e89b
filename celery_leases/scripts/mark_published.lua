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

  Output: number of records confirmed (OK for each; a record acquired,
  finished or re-claimed meanwhile is left alone)
]]
local deadlines, retention = KEYS[1], tonumber(ARGV[1])
local confirmed = 0
for i = 1, (#KEYS - 1) / 2 do
  local key, message = KEYS[2 * i], KEYS[2 * i + 1]
  local task_id, generation = ARGV[2 * i], ARGV[2 * i + 1]
  local v = wrongtype(key, redis.pcall('HMGET', key, 'state', 'generation'))
  if (v[1] == 'recovering' or v[1] == 'dead') and v[2] == generation then
    redis.call('ZREM', deadlines, task_id)
    if v[1] == 'dead' then
      redis.call('DEL', message)
    else
      redis.call('PEXPIRE', message, retention)
    end
    redis.call('PEXPIRE', key, retention)
    confirmed = confirmed + 1
  end
end
return confirmed
