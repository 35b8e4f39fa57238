-- interrupt: the lease holder found its session's last turn cut off (status running or parked,
-- nothing waited on, or a wait on an answer already handed over). That turn is never replayed:
-- this one step posts the item that tells the person, records the interruption for the next
-- turn to tell the agent, and ends the turn (idle; no wait, no delivery, no grant left).
--
-- KEYS[1] session hash   KEYS[2] items stream
-- KEYS[3] (optional) the hash of the prompt the session still waits on, when its answer was
--         already delivered (a resume refused as a second delivery)
-- ARGV[1] epoch   ARGV[2] item id   ARGV[3] author   ARGV[4] item body (JSON)
-- ARGV[5] the interruption (JSON), stored for the next turn
-- ARGV[6] the prompt id of that waited-on prompt, or ''
--
-- Returns {'posted', item id}, {'state', status} when no turn is cut off (already told: this
-- step ran before, on this replica or on one that adopted the thread in between, so the item is
-- posted once however often the holder dies), {'waiting', prompt id} when the session still
-- waits on an answer nobody was given (that is a parked wait, not an interruption), or
-- {'fenced', current epoch}. The grant goes too: a call the agent makes again asks a person.
local epoch, item_id, author, item_body, interruption, waited = unpack(ARGV)
local current = fenced(KEYS[1], epoch)
if current then return {'fenced', current} end
local status, wait = unpack(redis.call('HMGET', KEYS[1], 'status', 'wait'))
if status ~= 'running' and status ~= 'parked' then return {'state', status or ''} end
if wait then
  local id = cjson.decode(wait).prompt_id
  if id ~= waited or not KEYS[3] or not redis.call('HGET', KEYS[3], 'delivered') then
    return {'waiting', id}
  end
end
redis.call('XADD', KEYS[2], '*', 'id', item_id, 'author', author, 'type', 'agent_output',
  'body', item_body)
redis.call('HDEL', KEYS[1], 'wait', 'delivered', 'grant')
redis.call('HSET', KEYS[1], 'status', 'idle', 'interrupted', interruption)
return {'posted', item_id}
