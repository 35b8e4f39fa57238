-- step: take a pending prompt's due timing steps (reminders, escalation) once, and say whether
-- its deadline has come (broker/timing.py).
--
-- KEYS[1] prompt hash   KEYS[2] the thread's timing hash
--
-- The steps are the prompt's own (`timing` in its record), else its thread's. The record keeps
-- `fired`, the age (ms) of the last step taken, so each step is taken once however many
-- timekeepers look, and a timing changed later never repeats a step already past. Steps that
-- came due together (every timekeeper was down) are taken as one: the latest reminder, and the
-- escalation if it was among them. Expiry is never recorded here: the caller cancels the prompt,
-- which acts once (cancel.lua), so a caller that dies first leaves it for the next look. Steps
-- still untaken when the deadline has come are dropped: nobody is reminded of an expired prompt.
--
-- Returns {'gone'} (not pending), {'none'} (no timing), or
-- {outcome, kind, reminder, reminders, escalated_to, age_ms, next_ms or ''} with outcome
-- 'fired' (kind: the last step taken, remind or escalate), 'expire' or 'early' (nothing due).
local h = redis.call('HMGET', KEYS[1], 'state', 'created', 'timing', 'fired')
if h[1] ~= 'pending' then return {'gone'} end
local spec = h[3] or redis.call('HGET', KEYS[2], 'spec')
local created = tonumber(h[2])
if not spec or not created then return {'none'} end
local steps = cjson.decode(spec)['steps']
local age = now_ms() - created
local fired = tonumber(h[4] or '-1')
local reminders = 0
for _, s in ipairs(steps) do
  if s[2] == 'remind' then reminders = reminders + 1 end
end
local kind, reminder, escalated, taken, nxt = '', 0, '', nil, ''
for _, s in ipairs(steps) do
  local at = tonumber(s[1])
  if s[2] == 'expire' then
    if at <= age then
      return {'expire', '', '0', tostring(reminders), '', tostring(age), ''}
    end
    if nxt == '' then nxt = tostring(created + at) end
  elseif at > fired then
    if at <= age then
      taken, kind = at, s[2]
      if s[2] == 'remind' then reminder = s[3] else escalated = s[3] end
    elseif nxt == '' then
      nxt = tostring(created + at)
    end
  end
end
if not taken then
  return {'early', '', '0', tostring(reminders), '', tostring(age), nxt}
end
redis.call('HSET', KEYS[1], 'fired', taken)
if escalated ~= '' then redis.call('HSET', KEYS[1], 'escalated', escalated) end
return {'fired', kind, tostring(reminder), tostring(reminders), escalated, tostring(age), nxt}
