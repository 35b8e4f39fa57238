-- cancel: move a pending prompt to `cancelled` with a reason; a no-op when there is none.
--
-- KEYS[1] active   KEYS[2] session hash
-- ARGV[1] reason   ARGV[2] prompt id to cancel, or '' for the thread's active prompt
-- ARGV[3] lease epoch, or ''   ARGV[4] the thread's key base   ARGV[5] wake channel
--
-- Returns {'cancelled', prompt id}, {'none', ''} when nothing pending matched, or
-- {'fenced', current epoch}.
local current = fenced(KEYS[2], ARGV[3])
if current then return {'fenced', current} end

local prompt_id = ARGV[2]
if prompt_id == '' then prompt_id = redis.call('GET', KEYS[1]) end
if not prompt_id then return {'none', ''} end
if cancel_prompt(ARGV[4], prompt_id, ARGV[1], ARGV[5], now_ms()) then
  return {'cancelled', prompt_id}
end
return {'none', ''}
