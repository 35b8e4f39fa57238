-- resume: the lease holder takes the answer to a parked prompt into a resume turn, in one step:
-- the answer is marked delivered (the agent is about to get it), a one-shot grant is recorded
-- when the answer approves, and the session is marked running.
--
-- KEYS[1] session hash   KEYS[2] prompt hash
-- ARGV[1] epoch   ARGV[2] grant (JSON), or '' for none
--
-- Returns {'resumed', first delivery ms}, {'state', prompt state} when the prompt is not answered,
-- or {'fenced', current epoch}. Delivery keeps its first time, so a resume turn re-run after a
-- crash is the same delivery, not a second one.
local current = fenced(KEYS[1], ARGV[1])
if current then return {'fenced', current} end
local state, delivered = unpack(redis.call('HMGET', KEYS[2], 'state', 'delivered'))
if state ~= 'answered' then return {'state', state or ''} end
if not delivered then
  delivered = tostring(now_ms())
  redis.call('HSET', KEYS[2], 'delivered', delivered)
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'grant', ARGV[2]) end
redis.call('HSET', KEYS[1], 'status', 'running')
return {'resumed', delivered}
