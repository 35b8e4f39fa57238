-- claim: take a thread's session for a replica: a new lease and a new fencing epoch.
--
-- KEYS[1] session hash
-- ARGV[1] replica id   ARGV[2] lease ttl (ms)
--
-- Returns {'claimed', epoch, lease deadline ms}, {'held', owner, lease deadline ms} while another
-- replica's lease runs, {'missing'} or {'closed'}. The lease deadline is server time, and the
-- record (not the `leases` index) decides: a claim from a stale index entry is refused here.
-- Every claim bumps the epoch, so whatever the former owner still sends is refused.
local owner, until_, status = unpack(redis.call('HMGET', KEYS[1], 'owner', 'lease_until', 'status'))
if not status then return {'missing'} end
if status == 'closed' then return {'closed'} end
local now = now_ms()
if owner and owner ~= '' and owner ~= ARGV[1] and tonumber(until_ or 0) > now then
  return {'held', owner, until_}
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_until', deadline)
return {'claimed', tostring(epoch), tostring(deadline)}
