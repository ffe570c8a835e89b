--[[
  purge: delete finished lease records that finished at least a given time ago.

  For operators (celery leases purge): only terminal records (succeeded,
  failed, revoked, dead) whose finished_at is at or before now - min age are
  deleted. Active and recovering records and missing keys are left alone;
  corrupt ones (not hashes, unknown states, a finished_at that is not a number)
  too, and are reported. The state check and the delete are one atomic
  step, so a record that expired and was re-created by a new delivery between
  the caller's SCAN and this call is never deleted. A purged record no longer
  refuses late duplicate deliveries: such a copy would run again.

  Input:
    KEYS[1] deadlines sorted set (a left-over entry of a purged record is removed)
    KEYS[2..n] record hash of each candidate
    ARGV[1] minimum age in ms since finished_at (0: every finished record)
    ARGV[2..] task id of the record KEYS[k] (ARGV[k] for KEYS[k])

  Output: {code, purged, task id, what is corrupt, ...}, or {CORRUPT, key, field, detail}
    OK       purged is the number of records deleted; then each corrupt record, left alone
    CORRUPT  the deadline index is not a sorted set; nothing deleted
]]
local deadlines = KEYS[1]
local bad = check_type(deadlines, 'zset')
if bad then return bad end
local cutoff = now_ms() - tonumber(ARGV[1])
local purged = 0
local skipped = {}

for k = 2, #KEYS do
  local key = KEYS[k]
  local rec, bad_record = load(key, {'state', 'finished_at'}, {'finished_at'})
  if bad_record then
    -- Left alone for an operator, and reported; the rest of the batch goes on.
    table.insert(skipped, ARGV[k]); table.insert(skipped, bad_record[3] .. ' ' .. bad_record[4])
  else
    local state = rec.state
    local finished_at = tonumber(rec.finished_at or '0')
    -- A dead record still in the index has a failure notice pending: keep it.
    local pending = state == 'dead' and redis.call('ZSCORE', deadlines, ARGV[k])
    if is_terminal(state)
        and not pending and finished_at <= cutoff then
      redis.call('DEL', key)
      redis.call('ZREM', deadlines, ARGV[k])
      purged = purged + 1
    end
  end
end
return {OK, purged, unpack(skipped)}
