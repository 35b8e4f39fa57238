-- agent: append to a harness's own session data (e.g. a Claude Code transcript), in one step.
--
-- KEYS[1] the agent list   KEYS[2] the thread's set of agent names   KEYS[3] session hash
-- ARGV[1] the name (the part after `agent:`)   ARGV[2..] the entries to append (bytes)
--
-- Returns the list's length. The name is registered so a closed thread, when it is retired,
-- finds the list and expires it too; and a list written to a thread already retired (a turn
-- finishing after the close) takes the thread's remaining time, so nothing outlives it.
local n = redis.call('RPUSH', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
if redis.call('HGET', KEYS[3], 'status') == 'closed' then
  local left = redis.call('PTTL', KEYS[3])
  if left > 0 then
    redis.call('PEXPIRE', KEYS[1], left)
    redis.call('PEXPIRE', KEYS[2], left)
  end
end
return n
