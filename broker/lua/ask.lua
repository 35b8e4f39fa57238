-- ask: post a `pending_prompt` item and make it the thread's active prompt, in one step.
--
-- KEYS[1] items stream   KEYS[2] active   KEYS[3] the new prompt's hash   KEYS[4] session hash
-- ARGV[1] prompt id      ARGV[2] item id  ARGV[3] author   ARGV[4] item body (JSON)
-- ARGV[5] kind           ARGV[6] what mapping needs (JSON: broker/answers.py `matchers`)
-- ARGV[7] lease epoch, or '' when the caller holds none     ARGV[8] the thread's key base
-- ARGV[9] wake channel
-- ARGV[10] what the session is now waiting on (JSON {prompt_id, kind, subject}), or '' (with an
--          epoch: a replica's agent asks, so the session records the prompt its agent awaits)
-- ARGV[11] the agent's state to continue from this prompt (JSON), or '' to leave it as it is
-- ARGV[12] the stream's count limit   ARGV[13] its age limit in seconds (0: none; _retain.lua)
--
-- Returns {'ok', stream id, superseded prompt id or ''} or {'fenced', current epoch}.
--
-- The new item goes on the thread before the old prompt is cancelled `superseded`, as the spec
-- orders it; both happen here, so nobody ever sees two active prompts or none in between.
local current = fenced(KEYS[4], ARGV[7])
if current then return {'fenced', current} end

-- The questions live once, in the item; what mapping needs rides on the same stream entry
-- (`match`). The hash keeps only short fields, so Redis stores it compactly (a listpack).
local sid = redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'author', ARGV[3],
  'type', 'pending_prompt', 'body', ARGV[4], 'match', ARGV[6])
local created = string.match(sid, '^(%d+)')

local old = redis.call('GET', KEYS[2])
local superseded = ''
if old and old ~= ARGV[1] and cancel_prompt(ARGV[8], old, 'superseded', ARGV[9], now_ms()) then
  superseded = old
end

redis.call('HSET', KEYS[3], 'kind', ARGV[5], 'state', 'pending', 'item', ARGV[2], 'sid', sid,
  'created', created)
if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], 'epoch', ARGV[7]) end
if ARGV[10] ~= '' then redis.call('HSET', KEYS[4], 'wait', ARGV[10]) end
if ARGV[11] ~= '' then redis.call('HSET', KEYS[4], 'hstate', ARGV[11]) end
redis.call('SET', KEYS[2], ARGV[1])
trim_stream(ARGV[8], KEYS[1], ARGV[12], ARGV[13], tonumber(created))
return {'ok', sid, superseded}
