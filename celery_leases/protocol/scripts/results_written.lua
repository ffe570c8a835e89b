--[[
  results_written: Celery wrote these tasks' results; forget what was kept for them.

  The confirmation of a kept result (finish.lua) sent on its own: by recovery
  after writing it, or by a process with confirmations and no finish to carry
  them. Ids with nothing kept are ignored.

  Input:
    KEYS[1] unwritten results sorted set of a shard
    KEYS[2] unwritten results hash of that shard
    KEYS[3] stats hash of that shard
    ARGV[1] how many of these results recovery wrote (counted as results_written)
    ARGV[2..] task ids of that shard

  Output: {OK}, or {CORRUPT, key, field, detail} when a key is not of its type
    OK       the kept results of these ids are gone
    CORRUPT  KEYS[1] is not a sorted set or KEYS[2] not a hash; nothing written
]]
local index, results, stats = KEYS[1], KEYS[2], KEYS[3]
local bad = check_type(index, 'zset') or check_type(results, 'hash')
if bad then return bad end
drop_unwritten(index, results, ARGV, 2, #ARGV)
local wrote = tonumber(ARGV[1]) or 0
if wrote > 0 then count(stats, 'results_written', wrote) end
return {OK}
