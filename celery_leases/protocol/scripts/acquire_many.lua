--[[
  acquire_many: several acquires in one call, and the start marks waiting to be sent.

  The worker's acquirer sends in one call the acquires of every message its
  consumer received while the previous call was under way (or while its pool
  had work enough), and with them the start marks that have waited their
  delay (heartbeat.py): the server then parses one command and sets up the
  script once, and the marks need no call of their own. Each acquire is
  acquire.lua, unchanged: scripts.py embeds it here as the function
  acquire(kb, ab), run in a protected call, so that an error of one
  acquire (a server error raised half-way) is that acquire's reply alone and
  the others still run; it reads its keys and arguments where they are in this
  call's (scripts.py rewrites its KEYS[i] and ARGV[i] to offsets), so nothing
  is copied per acquire. The marks are mark_started.lua's (mark_starts).
  Every key must live on the one server the call goes to: not for a cluster.

  Input:
    ARGV[1] n: the number of acquires
    ARGV[2] m: the number of start marks (0 when none)
    ARGV[3] owner of the marked leases ('' when m is 0)
    ARGV[4..] the token of each marked lease (m of them), then the acquires' arguments,
              15 each (acquire.lua's ARGV[1..15]), in the order of their keys
    KEYS[1] the first acquire's record hash: the first six keys are its keys (acquire.lua's
            KEYS[1..6]), the next six the second acquire's, and so on, 6n in all
    KEYS[2..] the rest of the acquires' keys; after them, when m > 0, the stats hash the marks
              are counted in, then the record hash of each marked lease, in the order of the tokens

  Output: {reply_1, .., reply_n, marked}: reply_i is acquire.lua's reply to the i-th
  acquire, or an error reply for it alone; marked is the number of leases marked started.
]]
local NKEYS, NARGS = 6, 15
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
if not (n and m) or #KEYS ~= NKEYS * n + (m > 0 and m + 1 or 0) or #ARGV ~= 3 + m + NARGS * n then
  return redis.error_reply('ERR acquire_many: ' .. #KEYS .. ' keys and ' .. #ARGV
                           .. ' arguments do not match ' .. tostring(ARGV[1]) .. ' acquire(s) and '
                           .. tostring(ARGV[2]) .. ' start mark(s)')
end

-- The marks first: they are older than any acquire of this call.
local marked = 0
if m > 0 then
  -- (The marked records are the last m keys: mark_starts walks them in place.)
  marked = mark_starts(KEYS[NKEYS * n + 1], KEYS, NKEYS * n + 2, ARGV[3], ARGV, 4)
end

local replies = {}
for i = 1, n do
  local ok, reply = pcall(acquire, NKEYS * (i - 1), 3 + m + NARGS * (i - 1))
  if not ok then
    -- redis.call raises the server's error as {err = ...}; anything else is a script error.
    if type(reply) ~= 'table' or not reply.err then
      reply = {err = 'ERR acquire_many: acquire of task ' .. tostring(ARGV[3 + m + NARGS * (i - 1) + 1])
                     .. ' failed: ' .. tostring(reply)}
    end
  end
  replies[i] = reply
end
replies[n + 1] = marked
return replies
