-- claim: take a thread's session for a replica incarnation, with a new fencing epoch.
--
-- KEYS[1] session hash
-- ARGV[1] claimer replica id   ARGV[2] claimer incarnation
-- ARGV[3] the holder the caller read on the session ('' for none)   ARGV[4] that holder's incarnation
-- ARGV[5] the incarnation the caller read on that holder's replica record ('' for no record)
-- ARGV[6] that record's deadline (ms, server time; 0 for no record)
--
-- Returns {'claimed', epoch, former holder, its incarnation}, {'held', holder, incarnation} while
-- the holder is alive, {'moved', holder, incarnation} when the session no longer names the holder
-- the caller read (read it again), {'missing'} or {'closed'}.
--
-- A thread's lease is its holder's liveness. The holder's record lives in another slot, so the
-- caller reads it (after reading the session) and passes what it saw; this script checks that
-- the session still names that very holder and incarnation, and takes the thread only on
-- evidence of death, which is permanent: beat.lua never extends a record whose deadline passed
-- nor one of another incarnation, and incarnations are never reused. So a holder seen dead (its
-- record's incarnation is another one, or there is none, or its deadline passed) is dead now.
-- The deadline is checked again against this server's clock: a record seen expiring is taken
-- only once it expired here too. Every claim bumps the epoch, so whatever the former holder
-- still sends is refused.
local owner, inc, status = unpack(redis.call('HMGET', KEYS[1], 'owner', 'inc', 'status'))
if not status then return {'missing'} end
if status == 'closed' then return {'closed'} end
owner, inc = owner or '', inc or ''
if owner ~= ARGV[3] or inc ~= ARGV[4] then return {'moved', owner, inc} end
if owner ~= '' and ARGV[5] == inc and tonumber(ARGV[6]) > now_ms() then
  return {'held', owner, inc}
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'inc', ARGV[2])
redis.call('HDEL', KEYS[1], 'lease_until')
return {'claimed', tostring(epoch), owner, inc}
