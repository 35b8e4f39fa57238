-- grant: spend the thread's one-shot grant and post its `approval_granted` item, in one step.
--
-- KEYS[1] session hash   KEYS[2] items stream
-- ARGV[1] epoch   ARGV[2] the grant (JSON) exactly as read   ARGV[3] item id   ARGV[4] author
-- ARGV[5] item body (JSON)
--
-- Returns {'spent'}, {'changed'} when the grant is no longer the one read (spent by a racing
-- call, or replaced), or {'fenced', current epoch}. A grant can never be spent twice.
local current = fenced(KEYS[1], ARGV[1])
if current then return {'fenced', current} end
if redis.call('HGET', KEYS[1], 'grant') ~= ARGV[2] then return {'changed'} end
redis.call('HDEL', KEYS[1], 'grant')
redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'author', ARGV[4], 'type', 'approval_granted',
  'body', ARGV[5])
return {'spent'}
