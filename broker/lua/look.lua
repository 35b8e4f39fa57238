-- look: what a replica's batched look needs to know of threads it holds, and the park of a held
-- wait whose holder died, in one step (workers/runtime/sweep.py). One call looks at a page.
--
-- KEYS[2i-1] thread i's session hash   KEYS[2i] its inbox (on a cluster, one slot per call)
-- ARGV[1] the replica's id   ARGV[2] its incarnation
-- then two per thread, thread i's at ARGV[2i+1], ARGV[2i+2]: the lease epoch it holds, and the
-- thread's key base
--
-- Returns one reply per thread, in order, one of
--   'look'     the thread needs a look: lost (another holder, incarnation or epoch), messages
--              queued, a turn that died (running or parked with no wait), or its wait's
--              prompt no longer pending (answered, cancelled or gone)
--   'parked'   a held wait whose holder is gone (status running, its prompt pending): the
--              session is marked parked, here, under the epoch just checked
--   'quiet'    nothing to do: idle with nothing queued, or parked on a pending prompt
local function look(session, inbox, held_epoch, base)
  local owner, inc, epoch, status, wait = unpack(redis.call('HMGET', session, 'owner', 'inc', 'epoch', 'status', 'wait'))
  if owner ~= ARGV[1] or inc ~= ARGV[2] or epoch ~= held_epoch then return 'look' end
  if redis.call('LLEN', inbox) > 0 then return 'look' end
  if not wait or wait == '' then
    if status == 'running' or status == 'parked' then return 'look' end
    return 'quiet'
  end
  local prompt_id = cjson.decode(wait).prompt_id
  if redis.call('HGET', base .. 'prompt:' .. prompt_id, 'state') ~= 'pending' then return 'look' end
  if status ~= 'parked' then
    redis.call('HSET', session, 'status', 'parked')
    return 'parked'
  end
  return 'quiet'
end
local replies = {}
for i = 1, #KEYS / 2 do
  replies[i] = look(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i + 1], ARGV[2 * i + 2])
end
return replies
