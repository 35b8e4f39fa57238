-- Shared helpers, prepended to every script by broker/_scripts.py (Redis has no `require`).

-- The server's clock in ms: every timestamp the broker stores comes from here.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A JSON list of strings. Built by hand: cjson encodes an empty table as {}, not [].
local function json_strings(list)
  local parts = {}
  for i = 1, #list do parts[i] = cjson.encode(list[i]) end
  return '[' .. table.concat(parts, ',') .. ']'
end

-- [{"question": q, "answer": [...]}, ...] for parallel lists of questions and answer lists.
local function json_answers(questions, answers)
  local parts = {}
  for i = 1, #answers do
    parts[i] = '{"question":' .. cjson.encode(questions[i]) .. ',"answer":' .. json_strings(answers[i]) .. '}'
  end
  return '[' .. table.concat(parts, ',') .. ']'
end

-- Fencing: a call that carries a lease epoch is refused once the thread's epoch moved on.
-- An empty epoch means the caller holds no lease (a surface, the CLI): it is not fenced.
local function fenced(session_key, epoch)
  if epoch == '' then return false end
  local current = redis.call('HGET', session_key, 'epoch')
  if current ~= epoch then return current or '' end
  return false
end

-- Cancel a pending prompt: record the reason, clear the lock if it is this prompt's, ring the bell.
local function cancel_prompt(base, prompt_id, reason, wake, now)
  local key = base .. 'prompt:' .. prompt_id
  if redis.call('HGET', key, 'state') ~= 'pending' then return false end
  redis.call('HSET', key, 'state', 'cancelled', 'reason', reason, 'resolved', now)
  if redis.call('GET', base .. 'active') == prompt_id then redis.call('DEL', base .. 'active') end
  redis.call('PUBLISH', wake, '{"prompt_id":' .. cjson.encode(prompt_id)
    .. ',"state":"cancelled","reason":' .. cjson.encode(reason) .. '}')
  return true
end
