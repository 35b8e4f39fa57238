-- Retention helpers, prepended to every script after _lib.lua by broker/_scripts.py.
--
-- A thread's stream is trimmed where items are added (ask, route, audit), by this policy:
--   * count: at most `max_items` entries (0: no limit);
--   * age: entries older than `max_age` seconds go (0: no limit);
--   * never past a pin: `<base>pins` (sorted set, prompt id -> its creation ms) holds every
--     prompt whose `pending_prompt` entry is still needed (asked, not yet audited: the answer,
--     its delivery, a parked session resuming on it and the audit item all read its questions
--     from that entry). While a pin exists only the age rule trims, and never past the oldest
--     pin; the count rule waits until the pin goes (a stream cannot be trimmed from the middle).
-- Grants live in the session hash and the prompt hash, never in the stream.
-- Trimming is exact, not `~`: in the steady state each add drops one entry (cheap: the entry is
-- marked deleted in its node), and the bound is the one stated, not up to a node more.
--
-- A closed thread is retired by cancel.lua: every key of the thread gets the same expiry.
-- Its keys are found without scanning: `<base>prompts` (sorted set) names every prompt ever
-- asked on the thread, `<base>agents` (set) every harness key, `<base>idems` (sorted set)
-- every idempotency record.

local function pin_floor(base)
  local first = redis.call('ZRANGE', base .. 'pins', 0, 0, 'WITHSCORES')
  if first[2] then return tonumber(first[2]) end
  return nil
end

local function trim_stream(base, stream, max_items, max_age, now)
  max_items, max_age = tonumber(max_items) or 0, tonumber(max_age) or 0
  local floor = pin_floor(base)
  if max_age > 0 then
    local minid = now - max_age * 1000
    if floor and floor < minid then minid = floor end
    redis.call('XTRIM', stream, 'MINID', minid)
  end
  if max_items > 0 and not floor then
    redis.call('XTRIM', stream, 'MAXLEN', max_items)
  end
end

-- Give `key` an expiry of `ttl` seconds unless it already expires sooner.
local function expire_by(key, ttl)
  local left = redis.call('TTL', key)
  if left == -2 then return end
  if left < 0 or left > ttl then redis.call('EXPIRE', key, ttl) end
end

-- Every key of a closed thread expires in `ttl` seconds; an open prompt's record never does.
local function retire_thread(base, ttl)
  for _, prompt_id in ipairs(redis.call('ZRANGE', base .. 'prompts', 0, -1)) do
    local key = base .. 'prompt:' .. prompt_id
    if redis.call('HGET', key, 'state') ~= 'pending' then expire_by(key, ttl) end
  end
  for _, name in ipairs(redis.call('SMEMBERS', base .. 'agents')) do
    expire_by(base .. 'agent:' .. name, ttl)
  end
  for _, idem in ipairs(redis.call('ZRANGE', base .. 'idems', 0, -1)) do
    expire_by(base .. 'idem:' .. idem, ttl)
  end
  for _, suffix in ipairs({'items', 'active', 'inbox', 'session', 'pins', 'prompts', 'agents', 'idems'}) do
    expire_by(base .. suffix, ttl)
  end
end
