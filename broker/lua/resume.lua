-- resume: the lease holder hands the answer to a parked prompt to its agent in a resume turn, at
-- most once per prompt, ever: the answer is marked delivered, the session stops waiting on it and
-- records it as the delivery of the turn now running, and an approving answer mints its one-shot
-- grant, all in this one step under the holder's epoch.
--
-- KEYS[1] session hash   KEYS[2] prompt hash
-- ARGV[1] epoch   ARGV[2] grant (JSON), or '' for none   ARGV[3] the prompt id
-- ARGV[4] delivery token: one per attempt, kept across retries of that attempt
--
-- Returns {'resumed', delivery ms}, {'delivered', ms of the first delivery} when the answer was
-- already handed over (by a turn that was cut off: that turn is never replayed; the caller
-- reports it interrupted), {'state', prompt state} when the prompt is not answered ('' when there
-- is no such prompt), or {'fenced', current epoch}.
--
-- A retry of the same attempt (same token, its first reply lost on the way) gets 'resumed'
-- again with nothing written twice: it is the same delivery, and its turn has not started yet.
local epoch, grant, prompt_id, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = fenced(KEYS[1], epoch)
if current then return {'fenced', current} end
local state, delivered, delivery, granted =
  unpack(redis.call('HMGET', KEYS[2], 'state', 'delivered', 'delivery', 'granted'))
if state ~= 'answered' then return {'state', state or ''} end
if delivered then
  if token ~= '' and delivery == token then return {'resumed', delivered} end
  return {'delivered', delivered}
end
local now = tostring(now_ms())
redis.call('HSET', KEYS[2], 'delivered', now, 'delivery', token)
-- A grant is minted once per prompt, ever: a spent grant is never minted again.
if grant ~= '' and not granted then
  redis.call('HSET', KEYS[1], 'grant', grant)
  redis.call('HSET', KEYS[2], 'granted', now)
end
local wait = redis.call('HGET', KEYS[1], 'wait')
if wait and cjson.decode(wait).prompt_id == prompt_id then redis.call('HDEL', KEYS[1], 'wait') end
redis.call('HSET', KEYS[1], 'status', 'running', 'delivered', prompt_id)
return {'resumed', now}
