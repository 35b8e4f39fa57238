-- timing: set (or clear) a thread's timing for its prompts, or one pending prompt's own
-- (broker/timing.py).
--
-- KEYS[1] the thread's timing hash   KEYS[2] session hash   KEYS[3] items stream   KEYS[4] active
-- ARGV[1] the spec (JSON: the timing and its steps), or '' to clear it
-- ARGV[2] a prompt id, or '' for the thread's timing   ARGV[3] the thread's key base
--
-- Returns 'ok', 'nothread' (no items, no session), 'closed', or 'notpending' (the prompt named
-- is not pending: answered, cancelled or unknown).
if redis.call('EXISTS', KEYS[3]) == 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  return 'nothread'
end
if redis.call('HGET', KEYS[2], 'status') == 'closed' then return 'closed' end
if ARGV[2] ~= '' then
  local key = ARGV[3] .. 'prompt:' .. ARGV[2]
  if redis.call('HGET', key, 'state') ~= 'pending' then return 'notpending' end
  if ARGV[1] == '' then
    redis.call('HDEL', key, 'timing')
  else
    redis.call('HSET', key, 'timing', ARGV[1])
  end
  return 'ok'
end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'spec', ARGV[1])
end
return 'ok'
