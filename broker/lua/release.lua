-- release: give a thread up at once (clean shutdown), so another replica adopts it without
-- waiting for the holder's record to run out. The epoch moves on, fencing anything in flight.
--
-- KEYS[1] session hash
-- ARGV[1] replica id   ARGV[2] epoch
--
-- Returns {'released'} or {'lost'} when the replica no longer held it.
local owner, epoch = unpack(redis.call('HMGET', KEYS[1], 'owner', 'epoch'))
if owner ~= ARGV[1] or epoch ~= ARGV[2] then return {'lost'} end
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', '', 'inc', '')
redis.call('HDEL', KEYS[1], 'lease_until')
return {'released'}
