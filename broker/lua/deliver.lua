-- deliver: record that an answered prompt's answers were handed to the agent (once).
--
-- KEYS[1] prompt hash   KEYS[2] session hash
-- ARGV[1] lease epoch, or ''   ARGV[2] the prompt id
--
-- Returns {'delivered', ms}, {'already', ms of the first delivery}, {'state', the prompt's state
-- ('' when there is no such prompt)} or {'fenced', current epoch}. Only a delivered answer is ever
-- audited, so a replica that lost the thread cannot claim a delivery.
local current = fenced(KEYS[2], ARGV[1])
if current then return {'fenced', current} end

local state, delivered = unpack(redis.call('HMGET', KEYS[1], 'state', 'delivered'))
if state ~= 'answered' then return {'state', state or ''} end
if delivered then return {'already', delivered} end
local now = now_ms()
redis.call('HSET', KEYS[1], 'delivered', now)
-- The session's agent was waiting on this prompt and now has the answer: it waits no more.
local wait = redis.call('HGET', KEYS[2], 'wait')
if wait and cjson.decode(wait).prompt_id == ARGV[2] then redis.call('HDEL', KEYS[2], 'wait') end
return {'delivered', tostring(now)}
