-- deliver: record that an answered prompt's answers were handed to the agent (once).
--
-- KEYS[1] prompt hash   KEYS[2] session hash
-- ARGV[1] lease epoch, or ''
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
return {'delivered', tostring(now)}
