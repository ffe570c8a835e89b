--[[
  mark_started: record that the bodies of these leases started running.

  A lease is acquired when the worker receives the message, long before a
  prefetched task may run, so acquire records started = 0. Only a lease marked
  started here counts a recovery when its owner dies (claim_expired, acquire's
  take-over): tasks a dead worker had prefetched but never ran are not charged
  for its death. The worker sends these marks from its heartbeat thread, a few
  at a time, shortly after the pool started the tasks.

  Input:
    KEYS[1] stats hash (counts the marks, field started)
    KEYS[2..n] record hash of each lease, in the order of the tokens below
    ARGV[1] owner (worker instance id)
    ARGV[k] token of the lease whose record is KEYS[k]

  Output: number of leases marked (OK for each; leases the caller no longer
  holds are left alone)
]]
local suffix = '@' .. ARGV[1]
local marked = 0
for k = 2, #KEYS do
  local key = KEYS[k]
  local holder = wrongtype(key, redis.pcall('HGET', key, 'holder'))
  if holder == ARGV[k] .. suffix then
    redis.call('HSET', key, 'started', '1')
    marked = marked + 1
  end
end
if marked > 0 then redis.call('HINCRBY', KEYS[1], 'started', marked) end
return marked
