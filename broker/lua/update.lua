-- update: the lease holder sets (or, with an empty value, removes) fields of its session.
--
-- KEYS[1] session hash
-- ARGV[1] epoch   ARGV[2..] field, value, field, value, ...
--
-- Returns {'ok'} or {'fenced', current epoch}.
local current = fenced(KEYS[1], ARGV[1])
if current then return {'fenced', current} end
for i = 2, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return {'ok'}
