"""The Lua scripts of the slot leases (`leases.py`), one atomic step each in Redis.

Every script reads Redis `TIME`: leases, lines and grants are timed by Redis, never by
a replica's clock. The per-backend keys are the same for all of them (`_COMMON`).
"""

#: The scripts' common part. KEYS: slots zset, prefill hash, wanted flag, line zset,
#: grants counter (each grant's lease is named uniquely, even for a ticket granted twice).
#: Drops leases whose time is up (and their prefill entries); `serve_line` grants
#: free slots to the requests refused here before, best first: the line is ordered
#: by lane, then by when each request joined its lane's queue, over all replicas, as
#: one gateway's queue would be. A ticket is "<replica>#<request>#<prefill ms>"; its
#: grant is published ("grant <url> <ticket> <lease>") for its replica to use.
_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(expired))
end
local function prefill_ms()
  local sum = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do sum = sum + tonumber(v) end
  return sum
end
local function serve_line(count, prefill, limit, budget, ttl, channel, url)
  while count < limit do
    local head = redis.call('ZRANGE', KEYS[4], 0, 0)
    if #head == 0 then break end
    local ticket = head[1]
    local needs = tonumber(string.match(ticket, '#(%d+)$')) or 0
    if budget > 0 and prefill > 0 and prefill + needs > budget then break end
    redis.call('ZREM', KEYS[4], ticket)
    local lease = 'line:' .. ticket .. ':' .. redis.call('INCR', KEYS[5])
    redis.call('ZADD', KEYS[1], now + ttl, lease)
    if budget > 0 and needs > 0 then redis.call('HSET', KEYS[2], lease, needs) end
    count = count + 1
    prefill = prefill + needs
    redis.call('PUBLISH', channel, 'grant ' .. url .. ' ' .. ticket .. ' ' .. lease)
  end
  redis.call('PEXPIRE', KEYS[4], ttl * 4)
  redis.call('PEXPIRE', KEYS[5], ttl * 4)
  return count, prefill
end
"""

#: ARGV: lease, slot limit, ttl ms, this prompt's predicted prefill ms, prefill budget
#: ms (0: none), ticket, the request's place (lane index x 1e13 + Redis-time ms it
#: joined its queue, from the ms it has waited: ARGV[8]), channel, url.
#: Returns {granted (1; 0: slots full, -1: prefill budget full, -2: a request before it
#: in the fleet's line waits here), leases, prefill ms, ms until the first lease here
#: expires unless renewed}. Refused, it joins the line.
ACQUIRE = (
    _COMMON
    + """
local limit, ttl, mine, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local ticket = ARGV[6]
local place = tonumber(ARGV[7]) * 1e13 + now - tonumber(ARGV[8])
local count = redis.call('ZCARD', KEYS[1])
local prefill = prefill_ms()
local granted = 1
local head = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
if count >= limit then
  granted = 0
elseif budget > 0 and prefill > 0 and prefill + mine > budget then
  granted = -1
elseif #head > 0 and head[1] ~= ticket and tonumber(head[2]) < place then
  granted = -2
end
if granted ~= 1 then
  redis.call('SET', KEYS[3], '1', 'PX', ttl * 2)
  redis.call('ZADD', KEYS[4], 'NX', place, ticket)
  count, prefill = serve_line(count, prefill, limit, budget, ttl, ARGV[9], ARGV[10])
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local expires_in = ttl
  if #first > 0 then expires_in = math.max(0, tonumber(first[2]) - now) end
  return {granted, count, prefill, expires_in}
end
redis.call('ZREM', KEYS[4], ticket)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
if mine > 0 then redis.call('HSET', KEYS[2], ARGV[1], mine) end
redis.call('PEXPIRE', KEYS[1], ttl * 4)
redis.call('PEXPIRE', KEYS[2], ttl * 4)
return {1, count + 1, prefill + mine}
"""
)

#: ARGV: lease, 1 to release the slot (0: only its prefill ended), the channel, the
#: backend's url, slot limit, ttl ms, prefill budget ms. Serves the line, then
#: publishes the new counts when a replica was refused on this backend lately.
RELEASE = (
    _COMMON
    + """
if ARGV[2] == '1' then redis.call('ZREM', KEYS[1], ARGV[1]) end
redis.call('HDEL', KEYS[2], ARGV[1])
local count, prefill = serve_line(
  redis.call('ZCARD', KEYS[1]), prefill_ms(), tonumber(ARGV[5]), tonumber(ARGV[7]),
  tonumber(ARGV[6]), ARGV[3], ARGV[4])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. count .. ' ' .. prefill)
end
return {count, prefill}
"""
)

#: ARGV: ttl ms, slot limit, prefill budget ms, channel, url, then (lease, prefill ms)
#: pairs: this replica's leases on the backend, renewed (re-added if they had expired:
#: they still run). Serves the line (slots freed by expiry). Returns {leases, prefill
#: ms} over all replicas, and the ms until the first lease there expires unless renewed.
RENEW = (
    _COMMON
    + """
local ttl = tonumber(ARGV[1])
for i = 6, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
  if tonumber(ARGV[i + 1]) > 0 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
if #ARGV > 5 then
  redis.call('PEXPIRE', KEYS[1], ttl * 4)
  redis.call('PEXPIRE', KEYS[2], ttl * 4)
end
local count, prefill = serve_line(
  redis.call('ZCARD', KEYS[1]), prefill_ms(), tonumber(ARGV[2]), tonumber(ARGV[3]), ttl,
  ARGV[4], ARGV[5])
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local expires_in = ttl
if #first > 0 then expires_in = math.max(0, tonumber(first[2]) - now) end
return {count, prefill, expires_in}
"""
)

#: KEYS: the line zset. ARGV: tickets that no longer wait (served elsewhere, or gone).
LEAVE_LINE = """
for i = 1, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
return 0
"""


#: KEYS: the fleet's waiting set. ARGV: ttl ms, channel ('' : do not publish), then
#: (member, '1' add | '0' remove) pairs; a member is "<lane index>|<replica>": that
#: replica has requests of that lane waiting. Publishes when the set changed; returns
#: the live members.
WAITING = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ttl = tonumber(ARGV[1])
local changed = false
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '1' then
    if redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) == 1 then changed = true end
  elseif redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    changed = true
  end
end
redis.call('PEXPIRE', KEYS[1], ttl * 4)
if changed and ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], '~waiting') end
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
#: What WAITING publishes on the leases' channel when the fleet's waiting set changed.
WAITING_CHANGED = b"~waiting"
