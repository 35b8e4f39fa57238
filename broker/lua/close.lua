-- close: end a thread's session for good, in one step: no replica may hold it, and the epoch
-- moves on, so whatever its last holder still sends is refused (fenced) from here on.
--
-- KEYS[1] session hash
--
-- Returns {'closed', new epoch}, {'already'} when it was closed before, or {'missing'} when the
-- thread has no session (nothing is written: a typo never leaves a partial record behind).
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
if status == 'closed' then return {'already'} end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'status', 'closed', 'owner', '', 'inc', '')
redis.call('HDEL', KEYS[1], 'lease_until')
return {'closed', tostring(epoch)}
