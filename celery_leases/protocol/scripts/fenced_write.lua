--[[
  fenced_write: write one field of a fenced resource unless a newer token was already accepted for it.

  The resource's hash keeps the highest token accepted so far in its field
  "token". A write is accepted when the caller's token is not older than that
  (an equal token is accepted: the same owner may write again), and the write
  and the new fence are stored together, atomically. Nothing expires: the
  fence lives as long as the data it guards.

  Input:
    KEYS[1] fence hash of the resource
    ARGV[1] token of the caller (a positive integer)
    ARGV[2] hash field the value goes to ("value", or "field:<name>"; never "token")
    ARGV[3] value

  Output: {code, token}, or {CORRUPT, key, field, detail}
    OK           written; token is the caller's, now the resource's fence
    STALE_FENCE  refused, nothing written; token is the newer one already accepted
    CORRUPT      the fence is not a hash, or its token is not a number; nothing written
]]
local key = KEYS[1]
local token = tonumber(ARGV[1])
if token == nil then
  return redis.error_reply('ERR fenced_write: token ' .. tostring(ARGV[1]) .. ' for ' .. key .. ' is not a number')
end
local rec, bad = load(key, {'token'}, {'token'})
if bad then return bad end
local current = num(rec, key, 'token')
if token < current then return {STALE_FENCE, current} end
redis.call('HSET', key, 'token', ARGV[1], ARGV[2], ARGV[3])
return {OK, token}
