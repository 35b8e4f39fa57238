-- route: add an inbound item to the thread and decide, atomically, what it is.
--
-- KEYS[1] items stream   KEYS[2] active   KEYS[3] inbox   KEYS[4] session hash
-- ARGV[1] item id   ARGV[2] author   ARGV[3] item type ('' for a message)   ARGV[4] body (JSON)
-- ARGV[5] 'self' for the broker's own items and agent output (never an answer), else 'user'
-- ARGV[6] the prompt id the item names in metadata.prompt_id, or ''
-- ARGV[7] structured answers, shape already checked by Python (JSON), or ''
-- ARGV[8] why Python refused metadata.answers, or ''
-- ARGV[9] the prepared text (JSON, broker/answers.py `prepare`), or '' when the item has no
--         usable content (no non-empty text block and no file block)
-- ARGV[10] the thread's key base   ARGV[11] wake channel
-- ARGV[12] lease epoch, or '' when the poster holds none (people, surfaces)
-- ARGV[13] '1' to start the thread if it does not exist yet, '0' to refuse instead
-- ARGV[14] '1' when metadata.answers is malformed (ARGV[8] says how): with a prompt active the
--          text is mapped instead; with none, the item is refused rather than queued carrying it
-- ARGV[15] the surface the item came through ('http', 'cli', ...), or '': kept as `via` on the
--          prompt it answers, beside its author as `by`
-- ARGV[16] the caller's idempotency key, hashed (hex), or '': a post that took effect under it
--          is not made again; its first reply is returned (as {'repeat', reply JSON}), for a day
-- ARGV[17] the stream's count limit   ARGV[18] its age limit in seconds (0: none; _retain.lua)
-- On one server (not a cluster, where the event stream lives in another slot and the caller
-- writes the event after the reply): KEYS[5] the prompt event stream (broker/events.py), where
-- an answer writes its `prompt.answered` event in this same step; ARGV[19] the thread id
-- ARGV[20] the event stream's cap (MAXLEN ~)
--
-- Returns one of
--   {'posted', item id}                      a 'self' item, on the thread only
--   {'queued', item id}                      no active prompt: on the thread and in the inbox
--   {'answered', item id, prompt id, answers JSON, 'structured'|'text', refusal or ''}
--   {'stale', state, active prompt id or ''} it named another prompt: nothing written
--   {'bad', why}                             nothing usable to answer with: nothing written
--   {'fenced', current epoch}                a replica that lost the thread: nothing written
--   {'closed'}                               the thread's session is closed: nothing written
--   {'notfound'}                             no such thread and ARGV[13] is '0': nothing written
--
-- Text mapping is `map_prepared` of broker/answers.py, ported line for line (a property test
-- holds them equal); Python did the Unicode work (trim, case-fold, split, numbers) beforehand.

local function add_item()
  local sid = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'author', ARGV[2], 'type', ARGV[3], 'body', ARGV[4])
  trim_stream(ARGV[10], KEYS[1], ARGV[17], ARGV[18], tonumber(string.match(sid, '^(%d+)')))
  return sid
end

local function by_label(fold, m)
  if fold == '' then return nil end
  for i = 1, #m.labels do
    if m.folds[i] ~= '' and m.folds[i] == fold then return m.labels[i] end
  end
  return nil
end

local function resolve(tok, m)
  if tok.n >= 1 and tok.n <= #m.labels then return m.labels[tok.n] end
  return by_label(tok.f, m)
end

-- Greedy: at each word, the longest run of two or more words naming a label wins.
local function resolve_segment(words, m, out)
  local i = 1
  while i <= #words do
    local picked = nil
    for j = #words, i + 1, -1 do
      local run = {}
      for k = i, j do run[#run + 1] = words[k].f end
      picked = by_label(table.concat(run, ' '), m)
      if picked then i = j + 1; break end
    end
    if not picked then
      picked = resolve(words[i], m)
      i = i + 1
    end
    if picked then out[#out + 1] = picked end
  end
end

local function map_question(p, m)
  if #m.labels == 0 then return {p.raw} end
  if not m.multi then
    local label = resolve(p.whole, m)
    if label then return {label} end
    return {p.raw}
  end
  local out = {}
  for s = 1, #p.segs do resolve_segment(p.segs[s], m, out) end
  if #out == 0 then return {p.raw} end
  return out
end

-- A prompt asked before questions were stored folded has no `qfold`: fold it as far as Lua
-- can (ASCII case, ASCII whitespace). A question that differs beyond that is refused, and the
-- text is mapped: the safe side.
local function question_fold(m)
  if m.qfold ~= nil then return m.qfold end
  local words = {}
  for w in string.gmatch(string.lower(m.question), '%S+') do words[#words + 1] = w end
  return table.concat(words, ' ')
end

local function map_prepared(kind, ms, p)
  local out = {}
  for i = 1, #ms do
    if kind == 'text' then out[i] = {p.raw}
    elseif kind == 'approval' then out[i] = {p.aff and 'Approve' or 'Deny'}
    else out[i] = map_question(p, ms[i]) end
  end
  return out
end

local idem = (ARGV[16] ~= nil and ARGV[16] ~= '') and (ARGV[10] .. 'idem:' .. ARGV[16]) or nil
if idem then
  local first = redis.call('GET', idem)
  if first then return {'repeat', first} end
end
-- Every reply that wrote something goes through here, so a retry under the same key repeats it.
local function done(reply)
  if idem then
    redis.call('SET', idem, cjson.encode(reply), 'EX', 86400)
    -- Registered so a retired thread finds it; older than a day it has expired by itself.
    local now = now_ms()
    redis.call('ZADD', ARGV[10] .. 'idems', now, ARGV[16])
    redis.call('ZREMRANGEBYSCORE', ARGV[10] .. 'idems', '-inf', now - 86400000)
  end
  return reply
end

local current = fenced(KEYS[4], ARGV[12])
if current then return {'fenced', current} end

-- Decided here, not in Python, so a close landing between a check and the post cannot let an
-- item through. A thread exists once it has items or a session record.
if redis.call('HGET', KEYS[4], 'status') == 'closed' then return {'closed'} end
if ARGV[13] == '0' and redis.call('EXISTS', KEYS[1], KEYS[4]) == 0 then return {'notfound'} end

if ARGV[5] == 'self' then
  add_item()
  return done({'posted', ARGV[1]})
end

local base, named = ARGV[10], ARGV[6]
local active = redis.call('GET', KEYS[2])
if named ~= '' and named ~= active then
  local state = redis.call('HGET', base .. 'prompt:' .. named, 'state')
  return {'stale', state or 'unknown', active or ''}
end

local prompt = active and (base .. 'prompt:' .. active)
local kind, sid, state
if prompt then kind, sid, state = unpack(redis.call('HMGET', prompt, 'kind', 'sid', 'state')) end
if state ~= 'pending' then
  if ARGV[14] == '1' then return {'bad', ARGV[8]} end
  if ARGV[9] == '' then return {'bad', 'no prompt is active to answer, and the item has no content to queue'} end
  if active then redis.call('DEL', KEYS[2]) end  -- a dangling lock: the record decides
  local sid = add_item()
  redis.call('RPUSH', KEYS[3], cjson.encode({id = ARGV[1], author = ARGV[2], sid = sid, body = ARGV[4]}))
  redis.call('PUBLISH', ARGV[11], '{"queued":' .. cjson.encode(ARGV[1]) .. '}')
  return done({'queued', ARGV[1]})
end

-- What mapping needs was stored on the prompt's own stream entry at ask time.
local match = '[]'
local entry = redis.call('XRANGE', KEYS[1], sid, sid)[1]
if entry then
  local fields = entry[2]
  for i = 1, #fields, 2 do if fields[i] == 'match' then match = fields[i + 1] end end
end
local ms = cjson.decode(match)
local questions, answers, source, refusal = {}, nil, nil, ARGV[8]
for i = 1, #ms do questions[i] = ms[i].question end
if ARGV[7] ~= '' then
  -- `accept_structured` of broker/answers.py, ported line for line (a test holds them equal).
  local given = cjson.decode(ARGV[7])
  if #given ~= #ms then
    refusal = 'metadata.answers: the prompt has ' .. #ms .. ' question(s), the item answers ' .. #given
  else
    local named_wrong = nil
    for i = 1, #given do
      if given[i].qfold ~= nil and given[i].qfold ~= question_fold(ms[i]) then
        named_wrong = i
        break
      end
    end
    if named_wrong then
      local i = named_wrong
      refusal = 'metadata.answers[' .. (i - 1) .. '].question: "' .. given[i].question
        .. '" is not question ' .. i .. ' of the prompt ("' .. ms[i].question .. '")'
    else  -- every named question matched: the set answers, in the prompt's own words
      answers, source = {}, 'structured'
      for i = 1, #given do answers[i] = given[i].answer end
    end
  end
end
local raw = nil  -- the person's words, kept for the resume text of a parked approval
if not answers then
  if ARGV[9] == '' then return {'bad', refusal ~= '' and refusal or 'the item has no text and no metadata.answers'} end
  local prepared = cjson.decode(ARGV[9])
  answers, source, raw = map_prepared(kind, ms, prepared), 'text', prepared.raw
end

local encoded = json_answers(questions, answers)
-- The answer's item id is the server's time of the answer (XADD '*'): no TIME call. Each
-- redis.call costs a few microseconds, and an answer's step is on the person's path to the
-- agent's wake, so the record is written in one HSET.
local resolved = string.match(add_item(), '^(%d+)')
local record = {'state', 'answered', 'answers', encoded, 'source', source,
  'answer_item', ARGV[1], 'resolved', resolved, 'by', ARGV[2]}
if ARGV[15] ~= nil and ARGV[15] ~= '' then
  record[#record + 1] = 'via'
  record[#record + 1] = ARGV[15]
end
if raw then
  record[#record + 1] = 'text'
  record[#record + 1] = raw
end
redis.call('HSET', prompt, unpack(record))
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[11], '{"prompt_id":' .. cjson.encode(active)
  .. ',"state":"answered","answers":' .. encoded .. '}')
if KEYS[5] then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[20], '*', 'event', 'prompt.answered',
    'thread', ARGV[19], 'prompt', active,
    'data', '{"source":' .. cjson.encode(source) .. ',"answered_by":' .. cjson.encode(ARGV[2]) .. '}')
end
return done({'answered', ARGV[1], active, encoded, source, refusal})
