-- create: make a thread's agent session record, unowned, so any replica may claim it.
--
-- KEYS[1] session hash
-- ARGV[1] harness   ARGV[2] permissions   ARGV[3] harness config (JSON)   ARGV[4] work folder
-- ARGV[5] guarded policy block (JSON; empty for none)
--
-- Returns {'created', server ms} or {'exists'}.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
local now = now_ms()
redis.call('HSET', KEYS[1], 'harness', ARGV[1], 'permissions', ARGV[2], 'config', ARGV[3],
  'work_folder', ARGV[4], 'owner', '', 'inc', '', 'epoch', 0, 'status', 'idle', 'created', now)
if ARGV[5] ~= nil and ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'policy', ARGV[5]) end
return {'created', tostring(now)}
