-- claim: take threads' sessions for a replica incarnation, each with a new fencing epoch.
--
-- KEYS[i] thread i's session hash (on a cluster, every key of one call is of one slot)
-- ARGV[1] claimer replica id   ARGV[2] claimer incarnation
-- then four per thread, thread i's at ARGV[2 + 4(i-1) + 1 ..]:
--   the holder the caller read on its session ('' for none); that holder's incarnation;
--   the incarnation the caller read on that holder's replica record ('' for no record);
--   that record's deadline (ms, server time; 0 for no record)
--
-- Returns one reply per thread, in order: {'claimed', epoch, former holder, its incarnation},
-- {'held', holder, incarnation} while the holder is alive, {'moved', holder, incarnation} when
-- the session no longer names the holder the caller read (read it again), {'missing'} or
-- {'closed'}.
--
-- A thread's lease is its holder's liveness. The holder's record lives in another slot, so the
-- caller reads it (after reading the session) and passes what it saw; this script checks that
-- the session still names that very holder and incarnation, and takes the thread only on
-- evidence of death, which is permanent: beat.lua never extends a record whose deadline passed
-- nor one of another incarnation, and incarnations are never reused. So a holder seen dead (its
-- record's incarnation is another one, or there is none, or its deadline passed) is dead now.
-- The deadline is checked again against this server's clock: a record seen expiring is taken
-- only once it expired here too. Every claim bumps the epoch, so whatever the former holder
-- still sends is refused. One call claims a page of threads: one script run, not one each.
local now = now_ms()
local function claim(key, seen_owner, seen_inc, record_inc, record_until)
  local owner, inc, status = unpack(redis.call('HMGET', key, 'owner', 'inc', 'status'))
  if not status then return {'missing'} end
  if status == 'closed' then return {'closed'} end
  owner, inc = owner or '', inc or ''
  if owner ~= seen_owner or inc ~= seen_inc then return {'moved', owner, inc} end
  if owner ~= '' and record_inc == inc and tonumber(record_until) > now then
    return {'held', owner, inc}
  end
  local epoch = redis.call('HINCRBY', key, 'epoch', 1)
  redis.call('HSET', key, 'owner', ARGV[1], 'inc', ARGV[2])
  redis.call('HDEL', key, 'lease_until')
  return {'claimed', tostring(epoch), owner, inc}
end
local replies = {}
for i = 1, #KEYS do
  local a = 2 + 4 * (i - 1)
  replies[i] = claim(KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4])
end
return replies
