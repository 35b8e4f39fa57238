-- Retention helpers, prepended to every script after _lib.lua by broker/_scripts.py.
--
-- A thread's stream is trimmed where items are added (ask, route, audit), by this policy:
--   * count: at most `max_items` entries (0: no limit), plus up to TRIM_SLACK - 1 (31) added
--     since the last trim;
--   * age: entries older than `max_age` seconds go (0: no limit);
--   * never past an entry still needed: the `pending_prompt` entry of a prompt not yet audited
--     (the answer, its delivery, a parked session resuming on it and the audit item all read
--     its questions from it). Trimming walks the oldest entries and stops at the first such
--     one; what comes after it waits until that prompt is audited (a stream cannot be trimmed
--     from the middle). Grants live in the session and prompt hashes, never in the stream.
-- No index is kept for this (a key per thread costs ~200 B): the entries themselves are read.
-- Each add removes at most TRIM_BATCH entries, so a backlog (a long-open prompt just audited)
-- is cleared over a few adds, never in one long script. Trimming is exact (MINID), not `~`.
--
-- A closed thread is retired by cancel.lua: every key of the thread gets the same expiry.
-- Its keys are found without scanning the keyspace: prompts from the `pending_prompt` entries
-- still in the stream, and from `<base>prompts` (sorted set) for those whose entry was trimmed
-- while their record remained; `<base>agents` (set) names every harness key, `<base>idems`
-- (sorted set) every idempotency record.

local TRIM_BATCH = 1000
-- The count rule trims once the stream is this many entries over its limit, then back to the
-- limit: one trim per 32 adds instead of one per add (it halves the Redis CPU of a post).
local TRIM_SLACK = 32

-- The prompt id of a `pending_prompt` entry's body. Inside the body's text a quote is escaped,
-- so this unescaped sequence is only ever the metadata's own field.
local function entry_prompt(fields)
  local kind, body
  for i = 1, #fields, 2 do
    if fields[i] == 'type' then kind = fields[i + 1] elseif fields[i] == 'body' then body = fields[i + 1] end
  end
  if kind ~= 'pending_prompt' or not body then return nil end
  return string.match(body, '"prompt":{"prompt_id":"(prm_[0-9A-Z]+)"')
end

-- The id just after `id` (same ms, next sequence): an exclusive bound for XRANGE and XTRIM.
local function after(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms .. '-' .. tostring(tonumber(seq) + 1)
end

local function trim_stream(base, stream, max_items, max_age, now)
  max_items, max_age = tonumber(max_items) or 0, tonumber(max_age) or 0
  if max_items <= 0 and max_age <= 0 then return end
  local over = 0
  if max_items > 0 then over = redis.call('XLEN', stream) - max_items end
  local oldest = max_age > 0 and (now - max_age * 1000) or nil
  if over < TRIM_SLACK and not oldest then return end
  -- Walk from the oldest entry: the first read is one entry (at the head sits whatever
  -- stopped the last trim, often a prompt still open: then nothing more is read).
  local n, last, from, chunk = 0, nil, '-', 1
  while n < TRIM_BATCH do
    local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', chunk)
    if #entries == 0 then break end
    for i = 1, #entries do
      local id, fields = entries[i][1], entries[i][2]
      local young = not oldest or tonumber(string.match(id, '^(%d+)')) >= oldest
      if n >= over and young then return last and redis.call('XTRIM', stream, 'MINID', after(last)) end
      local prompt_id = entry_prompt(fields)
      if prompt_id then
        local key = base .. 'prompt:' .. prompt_id
        if redis.call('EXISTS', key) == 1 then
          if redis.call('HEXISTS', key, 'audit_item') == 0 then
            return last and redis.call('XTRIM', stream, 'MINID', after(last))
          end
          -- Its record outlives its entry: registered so a retired thread still finds it.
          redis.call('ZADD', base .. 'prompts', 0, prompt_id)
        end
      end
      n, last = n + 1, id
    end
    from = after(last)
    chunk = math.max(over - n + 1, oldest and 16 or 1)
    chunk = math.min(chunk, TRIM_BATCH - n + 1)
  end
  if last then redis.call('XTRIM', stream, 'MINID', after(last)) end
end

-- Give `key` an expiry of `ttl` seconds unless it already expires sooner.
local function expire_by(key, ttl)
  local left = redis.call('TTL', key)
  if left == -2 then return end
  if left < 0 or left > ttl then redis.call('EXPIRE', key, ttl) end
end

-- Every key of a closed thread expires in `ttl` seconds; an open prompt's record never does.
local function retire_thread(base, ttl)
  local function retire_prompt(prompt_id)
    local key = base .. 'prompt:' .. prompt_id
    if redis.call('HGET', key, 'state') ~= 'pending' then expire_by(key, ttl) end
  end
  for _, entry in ipairs(redis.call('XRANGE', base .. 'items', '-', '+')) do
    local prompt_id = entry_prompt(entry[2])
    if prompt_id then retire_prompt(prompt_id) end
  end
  for _, prompt_id in ipairs(redis.call('ZRANGE', base .. 'prompts', 0, -1)) do
    retire_prompt(prompt_id)
  end
  for _, name in ipairs(redis.call('SMEMBERS', base .. 'agents')) do
    expire_by(base .. 'agent:' .. name, ttl)
  end
  for _, idem in ipairs(redis.call('ZRANGE', base .. 'idems', 0, -1)) do
    expire_by(base .. 'idem:' .. idem, ttl)
  end
  for _, suffix in ipairs({'items', 'active', 'inbox', 'session', 'prompts', 'agents', 'idems', 'timing'}) do
    expire_by(base .. suffix, ttl)
  end
end
