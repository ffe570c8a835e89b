--[[
  Shared prelude, prepended by celery_leases/scripts.py to every script.
  Not a script of its own: it defines helpers only.

  now_ms()                   server clock in milliseconds (TIME), never a worker's
  wrongtype(key, reply)      a pcall reply, or an error naming the key (a key of the wrong type)
  read(key, fields...)       HMGET as a table keyed by field name
  num(rec, key, field)       a numeric field or an error naming key and field
  history_fields(key, n, e)  HSET arguments appending owner entry e (n entries so far)
  unstarted_limit(max)       recoveries allowed to a lease never marked started
]]
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

local function unstarted_limit(max_recoveries)
  -- A lease never marked started (mark_started.lua) costs its task no recovery
  -- when its worker dies: the task had probably only been prefetched. But its
  -- start mark may have died with the worker (a body that kills its worker in
  -- its first milliseconds), so these recoveries have a bound of their own,
  -- larger than max_recoveries: prefetched innocents outlive a poison pill's
  -- max_recoveries + 1 worker deaths, and nothing is recovered without end.
  return 4 * (max_recoveries + 1)
end
