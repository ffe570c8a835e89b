--[[
  release: give up leases at once (pool child died, warm shutdown, a dropped or requeued
  delivery) so recovery or a requeued delivery can take them without waiting out the ttl.

  Whether the release costs the task a recovery is decided here, from the record: a lease
  whose body started (its start mark, or the one riding with this call) is released as a
  death, counted by its next owner; one that never started is released unstarted, and its
  next owner counts nothing. A hand-back (Celery's Reject(requeue=True): the body gave the
  task back on purpose) is never a death.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2..n] record hash of each lease, in the order of the triples below
    ARGV[1] owner (worker instance id)
    ARGV[2] 1 for a hand-back (no recovery is counted), 0 otherwise
    ARGV[3k], ARGV[3k+1], ARGV[3k+2] task id, token and start mark (1: the caller knows
            the body started, a mark that may not have reached the record yet; 0: none)
            of the record KEYS[k+1]

  Output: {OK, released, task id, what is corrupt, task id, what is corrupt, ...}, or
  {CORRUPT, key, field, detail} when the deadline index is not a sorted set
    OK       released leases counted (leases the caller no longer owns are left alone);
             then each corrupt record, skipped (its ownership cannot be checked)
    CORRUPT  the deadline index is not a sorted set; nothing written
]]
local deadlines, owner, hand_back = KEYS[1], ARGV[1], ARGV[2] == '1'
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local now = now_ms()
local released = 0
local skipped = {}
for k = 2, #KEYS do
  local key = KEYS[k]
  local task_id, token, mark = ARGV[3 * k - 3], tonumber(ARGV[3 * k - 2]), ARGV[3 * k - 1]
  local rec, bad_record = load(key, {'state', 'token', 'owner', 'started'}, {'token'}, {'token'})
  if bad_record then
    -- Ownership cannot be checked on a corrupt record: left alone, reported.
    table.insert(skipped, task_id); table.insert(skipped, bad_record[3] .. ' ' .. bad_record[4])
  elseif rec.state == 'active' and num(rec, key, 'token') == token and rec.owner == owner then
    if hand_back or not (mark == '1' or rec.started == '1') then
      redis.call('HSET', key, 'owner', '', 'unstarted', '1')
    else
      redis.call('HSET', key, 'owner', '', 'unstarted', '0', 'started', '1')
    end
    redis.call('HDEL', key, 'holder')
    redis.call('ZADD', deadlines, now, task_id)
    released = released + 1
  end
end
return {OK, released, unpack(skipped)}
