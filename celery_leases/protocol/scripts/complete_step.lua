--[[
  complete_step: record a once-only step of a task as done, if the caller still owns the lease.

  Checked in order: the caller must be the owner (state active, same token,
  same owner), so an owner that lost its lease can never mark a step done for
  the owner that replaced it; then a step recorded earlier, by this owner or
  an earlier one, is reported and left as it is. Steps are fields
  "step:<name>" of the record itself, so they live exactly as long as it does
  (no expiry while the task is unfinished, retention after it finished).

  Input:
    KEYS[1] record hash of the task
    ARGV[1] owner (worker instance id)
    ARGV[2] token of the caller
    ARGV[3] step name

  Output: {code, token}, or {CORRUPT, key, field, detail}
    OK         recorded now; token is the caller's
    STEP_DONE  already recorded; token is that of the owner that recorded it
    LOST       the caller no longer owns the lease (token or owner differs, released, recovering)
    FINISHED   the record is terminal
    MISSING    there is no record for this task id
    CORRUPT    the record (its state, token or this step's field) is not what this protocol
               wrote; nothing written
]]
local key = KEYS[1]
local owner, token, step = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local field = 'step:' .. step
local rec, bad = load(key, {'state', 'token', 'owner', field}, {'token', field}, {'token'})
if bad then return bad end
local state = rec.state
if not state then return {MISSING, 0} end
local current = num(rec, key, 'token')
if is_terminal(state) then
  return {FINISHED, current}
end
if state ~= 'active' or current ~= token or rec.owner ~= owner then return {LOST, current} end

local done = rec[field]
if done then return {STEP_DONE, tonumber(done)} end
redis.call('HSET', key, field, ARGV[2])
return {OK, token}
