--[[
  Shared prelude, prepended by celery_leases/scripts.py to every script.
  Not a script of its own: it defines helpers only.

  now_ms()                   server clock in milliseconds (TIME), never a worker's
  wrongtype(key, reply)      a pcall reply, or an error naming the key (a key of the wrong type)
  read(key, fields...)       HMGET as a table keyed by field name
  num(rec, key, field)       a numeric field or an error naming key and field
  history_fields(key, n, e)  HSET arguments appending owner entry e (n entries so far)
  corrupt(key, field, detail)  the CORRUPT reply {CORRUPT, key, field, detail}
  check_type(key, want)      nil when key is missing or of type want, else a CORRUPT reply
                             (field "type"); checked before any write, since Redis does not
                             roll back a script that fails half-way
]]
local CORRUPT = 14
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function wrongtype(key, reply)
  if type(reply) == 'table' and reply.err then
    error({err = 'CORRUPT ' .. key .. ': ' .. reply.err})
  end
  return reply
end

local function read(key, ...)
  local names = {...}
  local values = wrongtype(key, redis.pcall('HMGET', key, unpack(names)))
  local rec = {}
  for i, name in ipairs(names) do rec[name] = values[i] end
  return rec
end

local function num(rec, key, field)
  local v = rec[field]
  if v == false or v == nil then return 0 end
  local n = tonumber(v)
  if n == nil then
    error({err = 'CORRUPT ' .. key .. ' field ' .. field .. ' is not a number: ' .. tostring(v)})
  end
  return n
end

local function history_fields(key, count, entry)
  -- The last 16 owners, one small field each ("h:0".."h:15", ring by count),
  -- so the record keeps Redis's compact hash encoding.
  return 'h:' .. (count % 16), entry, 'hn', count + 1
end

local function corrupt(key, field, detail)
  return {CORRUPT, key, field, detail}
end

local function check_type(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= want then
    return corrupt(key, 'type', 'is a ' .. t .. ', not a ' .. want)
  end
  return nil
end
