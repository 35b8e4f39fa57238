-- look: what a replica's batched look needs to know of one thread it holds, and the park of a
-- held wait whose holder died, in one step (workers/runtime/sweep.py).
--
-- KEYS[1] session hash   KEYS[2] inbox
-- ARGV[1] the replica's id   ARGV[2] its incarnation   ARGV[3] the lease epoch it holds
-- ARGV[4] the thread's key base
--
-- Returns one of
--   'look'     the thread needs a look: lost (another holder, incarnation or epoch), messages
--              queued, a turn that died (running or parked with no wait), or its wait's
--              prompt no longer pending (answered, cancelled or gone)
--   'parked'   a held wait whose holder is gone (status running, its prompt pending): the
--              session is marked parked, here, under the epoch just checked
--   'quiet'    nothing to do: idle with nothing queued, or parked on a pending prompt
local owner, inc, epoch, status, wait = unpack(redis.call('HMGET', KEYS[1], 'owner', 'inc', 'epoch', 'status', 'wait'))
if owner ~= ARGV[1] or inc ~= ARGV[2] or epoch ~= ARGV[3] then return 'look' end
if redis.call('LLEN', KEYS[2]) > 0 then return 'look' end
if not wait or wait == '' then
  if status == 'running' or status == 'parked' then return 'look' end
  return 'quiet'
end
local prompt_id = cjson.decode(wait).prompt_id
if redis.call('HGET', ARGV[4] .. 'prompt:' .. prompt_id, 'state') ~= 'pending' then return 'look' end
if status ~= 'parked' then
  redis.call('HSET', KEYS[1], 'status', 'parked')
  return 'parked'
end
return 'quiet'
