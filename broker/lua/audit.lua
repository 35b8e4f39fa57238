-- audit: post a prompt's `pending_prompt_resolved` item, exactly once.
--
-- KEYS[1] prompt hash   KEYS[2] items stream
-- ARGV[1] item id   ARGV[2] author   ARGV[3] item body (JSON)   ARGV[4] the state the body says
-- ARGV[5] retention in seconds for the resolved record, or '0' to keep it
-- ARGV[6] the thread's key base
-- ARGV[7] the stream's count limit   ARGV[8] its age limit in seconds (_retain.lua)
--
-- Returns {'posted', item id}, {'already', item id}, or {'refused', why}: the prompt is still
-- pending, an answer was never delivered (a resolution the agent never saw is never posted), or
-- the state is not the one the body was built from.
local state, delivered, posted = unpack(redis.call('HMGET', KEYS[1], 'state', 'delivered', 'audit_item'))
if posted then return {'already', posted} end
if not state then return {'refused', 'missing'} end
if state == 'pending' then return {'refused', 'pending'} end
if state == 'answered' and not delivered then return {'refused', 'undelivered'} end
if state ~= ARGV[4] then return {'refused', 'changed'} end

redis.call('XADD', KEYS[2], '*', 'id', ARGV[1], 'author', ARGV[2],
  'type', 'pending_prompt_resolved', 'body', ARGV[3])
redis.call('HSET', KEYS[1], 'audit_item', ARGV[1])
-- A retired (closed) thread's shorter expiry stands.
if ARGV[5] ~= '0' then expire_by(KEYS[1], tonumber(ARGV[5])) end
-- Its entry is no longer needed (the audit item carries the questions and answers): trimming
-- may now pass it.
trim_stream(ARGV[6], KEYS[2], ARGV[7], ARGV[8], now_ms())
return {'posted', ARGV[1]}
