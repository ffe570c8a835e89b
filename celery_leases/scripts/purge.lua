--[[
  purge: delete finished lease records that finished at least a given time ago.

  For operators (celery leases purge): only terminal records (succeeded,
  failed, revoked, dead) whose finished_at is at or before now - min age are
  deleted. Active and recovering records, missing keys, keys that are not
  hashes and records whose finished_at is not a number are left alone. The state check and the delete are one atomic
  step, so a record that expired and was re-created by a new delivery between
  the caller's SCAN and this call is never deleted. A purged record no longer
  refuses late duplicate deliveries: such a copy would run again.

  Input:
    KEYS[1] deadlines sorted set (a left-over entry of a purged record is removed)
    KEYS[2..n] record hash of each candidate
    ARGV[1] minimum age in ms since finished_at (0: every finished record)
    ARGV[2..] task id of the record KEYS[k] (ARGV[k] for KEYS[k])

  Output: {code, purged}
    OK  purged is the number of records deleted
]]
local deadlines = KEYS[1]
local cutoff = now_ms() - tonumber(ARGV[1])
local purged = 0

for k = 2, #KEYS do
  local key = KEYS[k]
  if redis.call('TYPE', key).ok == 'hash' then
    local rec = read(key, 'state', 'finished_at')
    local state = rec.state
    -- A finished_at that is not a number leaves the record alone rather than failing the batch.
    local finished_at = tonumber(rec.finished_at or '0')
    -- A dead record still in the index has a failure notice pending: keep it.
    local pending = state == 'dead' and redis.call('ZSCORE', deadlines, ARGV[k])
    if (state == 'succeeded' or state == 'failed' or state == 'revoked' or state == 'dead')
        and not pending and finished_at and finished_at <= cutoff then
      redis.call('DEL', key)
      redis.call('ZREM', deadlines, ARGV[k])
      purged = purged + 1
    end
  end
end
return {10, purged}
