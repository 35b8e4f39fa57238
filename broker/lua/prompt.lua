-- prompt: read a prompt's record and its item's body (where its questions live), in one step.
--
-- KEYS[1] prompt hash   KEYS[2] items stream
--
-- Returns {} when there is no such prompt, else {field, value, ..., '_body', item body JSON}.
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then return h end
local sid
for i = 1, #h, 2 do if h[i] == 'sid' then sid = h[i + 1] end end
local entry = sid and redis.call('XRANGE', KEYS[2], sid, sid)[1]
if entry then
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'body' then h[#h + 1] = '_body'; h[#h + 1] = fields[i + 1] end
  end
end
return h
