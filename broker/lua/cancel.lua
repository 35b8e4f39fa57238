-- cancel: move a pending prompt to `cancelled` with a reason; a no-op when there is none.
--
-- KEYS[1] active   KEYS[2] session hash
-- ARGV[1] reason   ARGV[2] prompt id to cancel, or '' for the thread's active prompt
-- ARGV[3] lease epoch, or ''   ARGV[4] the thread's key base   ARGV[5] wake channel
-- ARGV[6] seconds a closed thread's keys are kept, or '0' to keep them
--
-- On a closed thread (closing cancels its open prompt through here) every key of the thread is
-- given that expiry, in this same step (_retain.lua `retire_thread`): retiring is part of
-- closing, and running it again (closing again) changes nothing.
--
-- Returns {'cancelled', prompt id}, {'none', ''} when nothing pending matched, or
-- {'fenced', current epoch}.
local current = fenced(KEYS[2], ARGV[3])
if current then return {'fenced', current} end

local prompt_id = ARGV[2]
if prompt_id == '' then prompt_id = redis.call('GET', KEYS[1]) end
local reply = {'none', ''}
if prompt_id and cancel_prompt(ARGV[4], prompt_id, ARGV[1], ARGV[5], now_ms()) then
  reply = {'cancelled', prompt_id}
end
local ttl = tonumber(ARGV[6] or '0') or 0
if ttl > 0 and redis.call('HGET', KEYS[2], 'status') == 'closed' then
  retire_thread(ARGV[4], ttl)
end
return reply
