--[[
  finish_many: several finishes in one call (the outcomes nobody waits for, sent in the background).

  A worker whose tasks share one process (a threads pool) finishes the
  successes nobody reads a few milliseconds after they return, several in one
  write (worker/background.py). In one call the server parses one command,
  sets up the script once and reads its clock once, where a pipeline of
  finish.lua calls pays each of these per task. Each finish is finish.lua,
  unchanged: scripts.py embeds it here as the function finish(kb, ab, na), run
  in a protected call, so that an error of one finish (a server error raised
  half-way) is that finish's reply alone and the others still run; it reads
  its keys and arguments where they are in this call's (scripts.py rewrites its
  KEYS[i] and ARGV[i] to offsets, and its #ARGV to na), so nothing is copied
  per finish. Only finishes without finish.lua's optional tail ride here: an
  outcome that writes no result, keeps none and confirms none (the caller
  sends any other alone). Every key must live on the one server the call goes
  to: not for a cluster.

  Input:
    ARGV[1] n: the number of finishes
    ARGV[2..] the finishes' arguments, 6 each (finish.lua's ARGV[1..6]), in the order of their keys
    KEYS[1] the first finish's record hash: the first five keys are its keys (finish.lua's
            KEYS[1..5]), the next five the second finish's, and so on, 5n in all
    KEYS[2..] the rest of the finishes' keys

  Output: {reply_1, .., reply_n}: reply_i is finish.lua's reply to the i-th finish, or an
  error reply for it alone.
]]
local NKEYS, NARGS = 5, 6
local n = tonumber(ARGV[1])
if not n or n < 1 or #KEYS ~= NKEYS * n or #ARGV ~= 1 + NARGS * n then
  return redis.error_reply('ERR finish_many: ' .. #KEYS .. ' keys and ' .. #ARGV
                           .. ' arguments do not match ' .. tostring(ARGV[1]) .. ' finish(es) of '
                           .. NKEYS .. ' keys and ' .. NARGS .. ' arguments')
end

local replies = {}
for i = 1, n do
  local ok, reply = pcall(finish, NKEYS * (i - 1), 1 + NARGS * (i - 1), NARGS)
  if not ok then
    -- redis.call raises the server's error as {err = ...}; anything else is a script error.
    if type(reply) ~= 'table' or not reply.err then
      reply = {err = 'ERR finish_many: finish of task ' .. tostring(ARGV[1 + NARGS * (i - 1) + 1])
                     .. ' failed: ' .. tostring(reply)}
    end
  end
  replies[i] = reply
end
return replies
