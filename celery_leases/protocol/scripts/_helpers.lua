--[[
  Shared helpers: not a script of its own. celery_leases/protocol/scripts.py puts into
  each script's source only the helpers it calls (and those they call, which are always
  defined earlier in this file), and before them only the constants its code names: the
  return codes of celery_leases/protocol/codes.py (local OK = 10, local LOST = 7, ...: the
  Code enum is their only definition), KNOWN_STATES and TERMINAL_STATES, the sets of every
  state and of the terminal ones, and the call's memos: CLOCK, of the server clock (now_ms),
  and TYPES, of the keys' types (check_type).
  Each helper is one top-level `local function ... end`.

  now_ms()                   server clock in milliseconds (TIME), never a worker's; read once per
                             call
  or_corrupt(key, reply)     a pcall reply, or raise CORRUPT naming the key (a key of the wrong type)
  read(key, fields...)       HMGET as a table keyed by field name
  num(rec, key, field)       a numeric field or an error naming key and field
  history_fields(key, n, e)  HSET arguments appending owner entry e (n entries so far)
  corrupt(key, field, detail)  the CORRUPT reply {CORRUPT, key, field, detail}
  wrong_type(reply)          true for a pcall reply that is WRONGTYPE (other errors are raised)
  check_type(key, want)      nil when key is missing or of type want, else a CORRUPT reply
                             (field "type"); checked before any write, since Redis does not
                             roll back a script that fails half-way
  load(key, fields, numeric, required)
                             a record's fields (HMGET) as a table, validated: the key a hash,
                             state (if read) a known state, each numeric field present a whole
                             number, each required field present when the record exists, and
                             a hash with any of the fields read but no state is corrupt. Returns rec, or nil and the
                             CORRUPT reply naming key and field. Scripts load everything they
                             depend on first, then write.
  count(stats, field, n)     HINCRBY on a stats hash, best effort: a corrupt counter is not a
                             reason to refuse a task (the stats reads report it)
  unstarted_limit(max)       uncertain recoveries allowed to a task (charge_death)
  waited_limit(max)          waited deaths allowed to an isolated task (charge_death)
  charge_death(rec, key, limit)
                             how the death of an expired active lease's owner is charged to its
                             task (claim_expired, acquire's take-over): 'released', 'counted',
                             'waited' or 'uncertain', the task's recoveries and uncertain
                             recoveries after it, true when that death makes the task dead, true
                             when its next runs are isolated (a second uncertain death), and its
                             waited deaths after it (rec needs isolate and waited_deaths)
  is_terminal(state)         true for succeeded, failed, dead and revoked
  end_lease(key, deadlines, message, task_id, state, now, retention, ...)
                             write terminal ``state`` (and the extra field/value pairs
                             ``...``): the holder, the deadline and the stored message go,
                             the record is kept ``retention`` ms for late duplicates
  keep_token(seq, stats, token)
                             the one rule of a re-assert (a holder whose record vanished): raise
                             the token sequence to ``token`` so no later acquire hands it out
                             again, and count it; nil, or the CORRUPT reply for a corrupt sequence
  reassert_record(key, seq, stats, task_id, owner, token, now)
                             re-create a vanished record for the holder of ``token`` (a
                             failover lost the write that created it) and raise the token
                             sequence to it, so no later acquire hands out ``token`` or
                             below again; nil, or the CORRUPT reply for a corrupt sequence
  activate(key, deadlines, stats, message, lease, extra)
                             write the active lease ``lease`` (a table: task_id, owner, token,
                             now, ttl, generation, recoveries, attempt, progress_timeout, name,
                             max_recoveries, started, unstarted_recoveries, hn, body, envelope,
                             pub, persist, persist_message, ran: a run before this one may have
                             left fields to overwrite; queued: the record holds this task's id
                             and name; same_counts: it holds this generation, recoveries and
                             attempt; ``extra``: more field/value pairs),
                             store the message (with the publish id it belongs to) when a body
                             is given, index the deadline; the record loses any expiry unless
                             ``persist`` is false (a record that never had one), a kept stored
                             message only with ``persist_message``; acquire.lua and reassert.lua
  mark_starts(stats, keys, from, owner, tokens, at, alone)
                             mark started the leases whose records are keys[from..] and
                             whose tokens are tokens[at..] (in the same order), if
                             ``owner`` still holds them, and ``alone`` ('1') when the worker
                             runs each with nothing beside it; the number marked (counted as
                             ``started``); mark_started.lua and acquire_many.lua
  drop_unwritten(index, results, ids, from, to)
                             forget the kept results (unwritten.py) of ids[from..to]: Celery
                             wrote them; finish.lua (riding along) and results_written.lua
]]
local function now_ms()
  -- Read once per call (CLOCK is the call's own table): a script is one atomic step, and a
  -- call of many acquires (acquire_many) would otherwise pay a TIME for each.
  local ms = CLOCK[1]
  if not ms then
    local t = redis.call('TIME')
    ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    CLOCK[1] = ms
  end
  return ms
end

local function or_corrupt(key, reply)
  if type(reply) == 'table' and reply.err then
    error({err = 'CORRUPT ' .. key .. ': ' .. reply.err})
  end
  return reply
end

local function read(key, ...)
  local names = {...}
  local values = or_corrupt(key, redis.pcall('HMGET', key, unpack(names)))
  local rec = {}
  for i, name in ipairs(names) do rec[name] = values[i] end
  return rec
end

local function num(rec, key, field)
  local v = rec[field]
  if v == false or v == nil or v == '0' then return 0 end -- (a string compare, not a parse)
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

local function wrong_type(reply)
  -- True for a pcall reply that is WRONGTYPE; any other error is raised as it is.
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) then return true end
    error(reply)
  end
  return false
end

local function check_type(key, want)
  -- One TYPE per key and call (TYPES is the call's memo): a call's own writes never change
  -- a key's type, and acquire_many's acquires share their shard's keys.
  local t = TYPES[key]
  if not t then
    t = redis.call('TYPE', key).ok
    TYPES[key] = t
  end
  if t ~= 'none' and t ~= want then
    return corrupt(key, 'type', 'is a ' .. t .. ', not a ' .. want)
  end
  return nil
end

local function whole(v)
  if v == '0' then return 0 end -- the most common value, without a parse
  local n = tonumber(v)
  if n == nil or n ~= math.floor(n) or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end

local function load(key, fields, numeric, required)
  local values = redis.pcall('HMGET', key, unpack(fields))
  if wrong_type(values) then
    return nil, corrupt(key, 'type', 'is not a hash (' .. redis.call('TYPE', key).ok .. ')')
  end
  local rec = {}
  for i = 1, #fields do rec[fields[i]] = values[i] end
  local state = rec.state
  if state then
    if not KNOWN_STATES[state] then
      return nil, corrupt(key, 'state', 'is ' .. string.format('%q', state) .. ', not a known state')
    end
    if required then
      for i = 1, #required do
        if not rec[required[i]] then return nil, corrupt(key, required[i], 'is missing') end
      end
    end
  elseif rec.state == false then
    -- Without a state, a hash holding any of the other fields read is a broken record
    -- (a fresh task's key does not exist: all of them are missing, and no EXISTS is needed).
    for i = 1, #fields do
      if values[i] then return nil, corrupt(key, 'state', 'is missing') end
    end
  end
  if numeric then
    for i = 1, #numeric do
      local v = rec[numeric[i]]
      if v and not whole(v) then
        return nil, corrupt(key, numeric[i], 'is not a number: ' .. string.format('%q', v))
      end
    end
  end
  return rec
end

local function count(stats, field, n)
  local reply = redis.pcall('HINCRBY', stats, field, n)
  if type(reply) == 'table' and reply.err and not (string.find(reply.err, 'WRONGTYPE', 1, true)
      or string.find(reply.err, 'not an integer', 1, true)) then
    error(reply) -- READONLY (a failover) and the like: the server's own error, not a corrupt counter
  end
end

local function unstarted_limit(max_recoveries)
  -- Deaths whose blame is uncertain (charge_death) cost their task no recovery, but they
  -- have a bound of their own, larger than max_recoveries: an innocent that shared a few
  -- pills' deaths outlives them, and nothing is recovered without end (a worker that dies
  -- of its own accord, whatever it runs).
  return 4 * (max_recoveries + 1)
end

local function waited_limit(max_recoveries)
  -- Deaths of a worker while an isolated task waited there for its turn are never its own,
  -- and cost it nothing; their bound only stops a worker that keeps dying of something else
  -- from handing the task round without end. It is large: a pill's neighbours wait through
  -- every death of the pills isolated before them.
  return 4 * unstarted_limit(max_recoveries)
end

local function charge_death(rec, key, limit)
  -- The one rule for what a dead owner's lease costs its task (docs/recovery.md):
  --   released   its live worker gave it back unstarted (warm shutdown, a dropped request):
  --              that worker knew the body never ran; nothing is charged
  --   counted    its body ran and the death is its own: on a pool of one task per process
  --              (prefork, solo), or run alone on a shared-process pool (mark_starts alone):
  --              a recovery
  --   uncertain  never marked started (prefetched, or a body that died before its mark went
  --              out), or it ran beside other tasks in one process (threads, gevent,
  --              eventlet: any of them may have killed it): an uncertain recovery, bounded
  --              by unstarted_limit; from the second one on, its next runs are isolated
  --              (acquire's reply). One uncertain death is what a worker killed from outside
  --              (OOM, a deploy) costs each of its tasks: they run again as usual. A second
  --              one is a pattern (a pill, or a task beside pills): isolation settles it.
  --   waited     isolated, and never marked started: an isolated run's start is marked before
  --              its body (the worker runs no isolated body without that mark), so its body
  --              never ran and the death is another task's (it waited for its turn, or was
  --              prefetched, while something else killed the worker): a waited death, not
  --              charged, bounded by waited_limit; it stays isolated
  -- (Records without a started field predate it and count as started.)
  local recoveries = num(rec, key, 'recoveries')
  local uncertain = num(rec, key, 'unstarted_recoveries')
  if rec.unstarted == '1' then return 'released', recoveries, uncertain, false, false end
  if rec.started ~= '0' and (rec.shared ~= '1' or rec.alone == '1') then
    if recoveries >= limit then return 'counted', recoveries, uncertain, true, false end
    return 'counted', recoveries + 1, uncertain, false, false
  end
  if rec.isolate == '1' and rec.started == '0' then
    local waited = num(rec, key, 'waited_deaths') + 1
    return 'waited', recoveries, uncertain, waited > waited_limit(limit), true, waited
  end
  uncertain = uncertain + 1
  return 'uncertain', recoveries, uncertain, uncertain > unstarted_limit(limit), uncertain >= 2
end

local function is_terminal(state)
  return TERMINAL_STATES[state] == true
end

local function end_lease(key, deadlines, message, task_id, state, now, retention, ...)
  redis.call('HSET', key, 'state', state, 'finished_at', now, ...)
  redis.call('HDEL', key, 'holder')
  redis.call('DEL', message)
  redis.call('ZREM', deadlines, task_id)
  redis.call('PEXPIRE', key, retention)
end

local function keep_token(seq, stats, token)
  local raw = redis.call('GET', seq)
  if raw and not whole(raw) then return corrupt(seq, 'value', 'is not a number: ' .. string.format('%q', raw)) end
  if (raw and whole(raw) or 0) < token then redis.call('SET', seq, string.format('%d', token)) end
  count(stats, 'reasserted', 1)
  return nil
end

local function reassert_record(key, seq, stats, task_id, owner, token, now)
  local tok = string.format('%d', token)
  local bad = keep_token(seq, stats, token)
  if bad then return bad end
  redis.call('HSET', key, 'task_id', task_id, 'token', tok, 'owner', owner, 'acquired_at', now,
             history_fields(key, 0, tok .. '@' .. owner .. '@' .. string.format('%d', now)))
  return nil
end

local function owner_guard(key, seq, stats, rec, current, task_id, owner, token, now)
  -- The owner's guard of finish and hand_over: nil when (owner, token) holds the live lease
  -- (a vanished record is re-created for its holder first), else the reply to return.
  if not rec.state then
    if token <= 0 then return {MISSING, 0, ''} end
    return reassert_record(key, seq, stats, task_id, owner, token, now)
  elseif is_terminal(rec.state) then
    if current ~= token then count(stats, 'refused', 1) end
    return {FINISHED, current, rec.state}
  elseif rec.state ~= 'active' or current ~= token or rec.owner ~= owner then
    count(stats, 'refused', 1)
    return {LOST, current, rec.state}
  end
  return nil
end

local function activate(key, deadlines, stats, message, l, extra)
  local tok = string.format('%d', l.token)
  -- The progress timeout bounds a running body: it starts with the start mark (mark_starts),
  -- not at receipt, where a prefetched task may wait longer than it to start.
  local progress_deadline = 0
  if l.progress_timeout > 0 and l.started == '1' then progress_deadline = l.now + l.progress_timeout end
  -- Each field costs the HSET its time (the record is a compact hash, searched field by
  -- field), so a field the record already holds with the value to write is left alone:
  -- a task recorded at publish holds its id and name (l.queued), and its counts unless
  -- they change (l.same_counts).
  local fields = {
    'state', 'active', 'token', tok, 'owner', l.owner,
    'holder', tok .. '@' .. l.owner, 'ttl', l.ttl, 'acquired_at', l.now,
    'max_recoveries', l.max_recoveries, 'started', l.started,
    history_fields(key, l.hn, tok .. '@' .. l.owner .. '@' .. string.format('%d', l.now))}
  local n = #fields
  if not l.queued then
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] = 'task_id', l.task_id, 'name', l.name
    n = n + 4
  end
  if not l.same_counts then
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4], fields[n + 5], fields[n + 6] =
      'generation', l.generation, 'recoveries', l.recoveries, 'attempt', l.attempt
    n = n + 6
  end
  -- Fields whose absence reads as 0 (and as not released) are written only when they are not
  -- 0 or an earlier run (l.ran) may have left them.
  if l.ran or l.progress_timeout > 0 then
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] =
      'progress_timeout', l.progress_timeout, 'progress_deadline', progress_deadline
    n = n + 4
  end
  if l.ran or l.unstarted_recoveries > 0 then
    fields[n + 1], fields[n + 2], fields[n + 3], fields[n + 4] =
      'unstarted', '0', 'unstarted_recoveries', l.unstarted_recoveries
    n = n + 4
  end
  if extra then
    for i = 1, #extra do fields[n + i] = extra[i] end
  end
  redis.call('HSET', key, unpack(fields))
  if l.body ~= '' then
    redis.call('HSET', message, 'body', l.body, 'envelope', l.envelope, 'pub', l.pub or '')
    redis.call('PERSIST', message)
  elseif l.persist_message then
    redis.call('PERSIST', message)
  end
  if l.persist ~= false then redis.call('PERSIST', key) end
  redis.call('ZADD', deadlines, l.now + l.ttl, l.task_id)
  count(stats, 'acquired', 1)
end

local function mark_starts(stats, keys, from, owner, tokens, at, alone)
  local suffix = '@' .. owner
  local marked = 0
  local now
  for k = from, #keys do
    local key = keys[k]
    local v = or_corrupt(key, redis.pcall('HMGET', key, 'holder', 'progress_timeout', 'progress_deadline'))
    if v[1] == tokens[at + k - from] .. suffix then
      local progress_timeout = whole(v[2]) or 0
      if progress_timeout > 0 and (whole(v[3]) or 0) == 0 then
        -- The body started: its progress timeout runs from now (activate leaves it unset).
        now = now or now_ms()
        redis.call('HSET', key, 'started', '1', 'progress_deadline', now + progress_timeout)
      else
        redis.call('HSET', key, 'started', '1')
      end
      if alone == '1' then redis.call('HSET', key, 'alone', '1') end
      marked = marked + 1
    end
  end
  if marked > 0 then count(stats, 'started', marked) end
  return marked
end

local function drop_unwritten(index, results, ids, from, to)
  for i = from, to do
    redis.call('ZREM', index, ids[i])
    redis.call('HDEL', results, ids[i])
  end
end
