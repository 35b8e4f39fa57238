-- beat: a replica says it is alive; returns how many replicas are.
--
-- KEYS[1] the replicas sorted set (replica id -> last beat, server ms)
-- ARGV[1] replica id   ARGV[2] how long a beat counts (ms)   ARGV[3] '1' to leave instead
--
-- Returns the number of replicas that beat within ARGV[2] ms (this one included unless leaving).
-- Only a discovery index: it balances adoption and feeds `status`; nothing is decided by it.
local now = now_ms()
if ARGV[3] == '1' then redis.call('ZREM', KEYS[1], ARGV[1])
else redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 10 * tonumber(ARGV[2]))
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[2]), '+inf')
