-- enqueue: arq's `enqueue_job` in one step, so it can ride in a pipeline beside a thread script.
--
-- KEYS[1] arq job key   KEYS[2] arq result key   KEYS[3] arq queue (sorted set)
-- ARGV[1] job id   ARGV[2] serialized job (arq's own serialize_job)   ARGV[3] expiry ms
-- ARGV[4] score (enqueue time, ms)
--
-- Returns 1 when enqueued, 0 when that job id is already queued, running or holds a result:
-- the same check arq makes under WATCH, without the extra round trips.
if redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
