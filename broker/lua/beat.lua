-- beat: the replica records. A replica proves it is alive here, once per interval, in one write
-- whatever it holds; adopters read the records here to learn who is dead.
--
-- KEYS[1] the replicas sorted set (replica id -> last beat, server ms: for status and counts)
-- KEYS[2] the replica records hash (replica id -> '<incarnation>|<deadline ms>'), same slot
-- ARGV[1] 'join', 'beat', 'leave', 'bury' or 'look'   ARGV[2] replica id   ARGV[3] incarnation
-- ARGV[4] how long a beat counts (ms)
--
-- join: a new incarnation of the replica (a process start, or one that found itself dead): any
--   earlier incarnation of that id is dead from here on, for good. Returns {'alive', deadline,
--   the superseded incarnation or ''}.
-- beat: extend the deadline, only while this incarnation's record is there and its deadline has
--   not passed. Returns {'alive', deadline} or {'dead', the record's incarnation or ''}. A record
--   whose deadline passed is never extended: once adopters may have seen it expired, that
--   incarnation stays dead (this is what makes an adopter's observation of it safe to act on).
-- leave: a clean stop removes its own record. Returns {'left'} (or {'gone'}: not its record).
-- bury: an adopter removes an expired record once nothing is left to adopt from it.
--   Returns {'buried'} or {'kept'} (it is not that incarnation's, or its deadline has not passed).
-- look: returns {server ms, id, record, id, record, ...} for every replica.
local mode, id, inc = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
if mode == 'look' then
  local out = {tostring(now)}
  for _, v in ipairs(redis.call('HGETALL', KEYS[2])) do out[#out + 1] = v end
  return out
end
local cur = redis.call('HGET', KEYS[2], id)
local cur_inc, cur_until = '', 0
if cur then
  local bar = string.find(cur, '|', 1, true)
  cur_inc, cur_until = string.sub(cur, 1, bar - 1), tonumber(string.sub(cur, bar + 1))
end
if mode == 'leave' then
  if cur_inc ~= inc then return {'gone'} end
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  return {'left'}
end
if mode == 'bury' then
  if cur_inc ~= inc or cur_until > now then return {'kept'} end
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  return {'buried'}
end
if mode == 'beat' and (cur_inc ~= inc or cur_until <= now) then return {'dead', cur_inc} end
local deadline = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[2], id, inc .. '|' .. deadline)
redis.call('ZADD', KEYS[1], now, id)
if mode == 'join' and cur_inc ~= inc then return {'alive', tostring(deadline), cur_inc} end
return {'alive', tostring(deadline)}
