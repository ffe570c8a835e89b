--[[
  expired: list task ids whose deadline passed, by the server clock (read-only).

  Input:
    KEYS[1] deadlines sorted set
    ARGV[1] how many ids at most

  Output: {now in ms, task id, task id, ...}, or {CORRUPT, key, field, detail}
    CORRUPT  the deadline index is not a sorted set
]]
local bad = check_type(KEYS[1], 'zset')
if bad then return bad end
local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
table.insert(ids, 1, now)
return ids
