--[[
  release: give up leases at once (pool child died, warm shutdown) so recovery
  or a requeued delivery can take them without waiting out the ttl.

  Input:
    KEYS[1] deadlines sorted set
    KEYS[2..n] record hash of each lease, in the order of the pairs below
    ARGV[1] owner (worker instance id)
    ARGV[2] 1 when the leases never started running (warm shutdown): the next
            owner then does not count a recovery; 0 when they were running (a
            pool child died): marked started, so the next owner counts one
    ARGV[2k+1], ARGV[2k+2] task id and token of the record KEYS[k+1]

  Output: {OK, released, task id, what is corrupt, task id, what is corrupt, ...}, or
  {CORRUPT, key, field, detail} when the deadline index is not a sorted set
    OK       released leases counted (leases the caller no longer owns are left alone);
             then each corrupt record, skipped (its ownership cannot be checked)
    CORRUPT  the deadline index is not a sorted set; nothing written
]]
local deadlines, owner, unstarted = KEYS[1], ARGV[1], ARGV[2]
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local now = now_ms()
local released = 0
local skipped = {}
for k = 2, #KEYS do
  local key = KEYS[k]
  local task_id, token = ARGV[2 * k - 1], tonumber(ARGV[2 * k])
  local rec, bad_record = load(key, {'state', 'token', 'owner'}, {'token'}, {'token'})
  if bad_record then
    -- Ownership cannot be checked on a corrupt record: left alone, reported.
    table.insert(skipped, task_id); table.insert(skipped, bad_record[3] .. ' ' .. bad_record[4])
  elseif rec.state == 'active' and num(rec, key, 'token') == token and rec.owner == owner then
    if unstarted == '1' then
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
