-- renew: extend a replica's lease on a thread, if it still holds it at that epoch.
--
-- KEYS[1] session hash
-- ARGV[1] replica id   ARGV[2] epoch   ARGV[3] lease ttl (ms)
--
-- Returns {'renewed', lease deadline ms} or {'lost', current owner, current epoch}.
local owner, epoch = unpack(redis.call('HMGET', KEYS[1], 'owner', 'epoch'))
if owner ~= ARGV[1] or epoch ~= ARGV[2] then return {'lost', owner or '', epoch or ''} end
local deadline = now_ms() + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lease_until', deadline)
return {'renewed', tostring(deadline)}
