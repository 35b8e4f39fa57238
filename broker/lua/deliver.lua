-- deliver: record that an answered prompt's answers are handed to the agent, at most once.
--
-- KEYS[1] prompt hash   KEYS[2] session hash
-- ARGV[1] lease epoch, or ''   ARGV[2] the prompt id
-- ARGV[3] delivery token, or '' (absent for callers that hand over regardless: a plain `wait`)
--
-- Returns {'delivered', ms}, {'already', ms of the first delivery}, {'state', the prompt's state
-- ('' when there is no such prompt)} or {'fenced', current epoch}. Only a delivered answer is ever
-- audited, so a replica that lost the thread cannot claim a delivery. A retry of the same attempt
-- (same non-empty token, its first reply lost) gets 'delivered' again with nothing rewritten; any
-- other second call gets 'already', and a holder must then not hand the answer over.
--
-- With an epoch the caller is the session's holder: when its agent was waiting on this prompt,
-- the session waits no more and records this as the delivery of the running turn (a turn cut off
-- after it is then reported interrupted, never replayed). An unfenced caller (a library user's
-- own wait) never touches the session.
local epoch, prompt_id, token = ARGV[1], ARGV[2], ARGV[3] or ''
local current = fenced(KEYS[2], epoch)
if current then return {'fenced', current} end

local state, delivered, delivery = unpack(redis.call('HMGET', KEYS[1], 'state', 'delivered', 'delivery'))
if state ~= 'answered' then return {'state', state or ''} end
if delivered then
  if token ~= '' and delivery == token then return {'delivered', delivered} end
  return {'already', delivered}
end
local now = tostring(now_ms())
redis.call('HSET', KEYS[1], 'delivered', now)
if token ~= '' then redis.call('HSET', KEYS[1], 'delivery', token) end
if epoch ~= '' then
  local wait = redis.call('HGET', KEYS[2], 'wait')
  if wait and cjson.decode(wait).prompt_id == prompt_id then
    redis.call('HDEL', KEYS[2], 'wait')
    redis.call('HSET', KEYS[2], 'delivered', prompt_id)
  end
end
return {'delivered', now}
