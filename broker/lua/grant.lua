-- grant: spend the thread's one-shot grant and post its `approval_granted` item, in one step.
--
-- KEYS[1] session hash   KEYS[2] items stream   KEYS[3] the granting prompt's hash
-- ARGV[1] epoch   ARGV[2] the grant (JSON) exactly as read   ARGV[3] item id   ARGV[4] author
-- ARGV[5] item body (JSON)
--
-- Returns {'spent'}, {'changed'} when the grant is no longer the one read (spent by a racing
-- call, or replaced), {'used', item id} when the prompt that granted it already had a grant
-- spent (the stray grant is dropped: a prompt approves one call, ever), or {'fenced', current
-- epoch}. A grant can never be spent twice.
local current = fenced(KEYS[1], ARGV[1])
if current then return {'fenced', current} end
if redis.call('HGET', KEYS[1], 'grant') ~= ARGV[2] then return {'changed'} end
local used = redis.call('HGET', KEYS[3], 'grant_item')
if used then
  redis.call('HDEL', KEYS[1], 'grant')
  return {'used', used}
end
redis.call('HDEL', KEYS[1], 'grant')
redis.call('HSET', KEYS[3], 'grant_item', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'author', ARGV[4], 'type', 'approval_granted',
  'body', ARGV[5])
return {'spent'}
