-- compact: replace the last elements of a harness's list by one compressed batch of them.
--
-- KEYS[1] the agent list
-- ARGV[1] the list's length when they were read   ARGV[2] how many (the last ones) to replace
-- ARGV[3] the batch (workers/runtime/agent_store.py)   ARGV[4] the first of those elements, as read
--
-- Returns 1 when replaced, 0 when the list changed since it was read (appended to, or
-- compacted by another call): then nothing is written and the elements stay as they are.
-- Elements are only ever appended, so an unchanged length and first element mean the last
-- ARGV[2] are the ones read. LSET then LTRIM: the list never empties, so its expiry stands.
local n, k = tonumber(ARGV[1]), tonumber(ARGV[2])
if redis.call('LLEN', KEYS[1]) ~= n then return 0 end
if redis.call('LINDEX', KEYS[1], n - k) ~= ARGV[4] then return 0 end
redis.call('LSET', KEYS[1], n - k, ARGV[3])
redis.call('LTRIM', KEYS[1], 0, n - k)
return 1
