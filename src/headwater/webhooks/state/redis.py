"""The webhook state in Redis (the seed's choice), shared by webhook workers on any number of
processes and machines. Every step that reads and then writes is one Lua script, so it is atomic
on the server; the rate limit's clock is the server's (``TIME``), the same for every worker.

Keys (under ``prefix``): ``m:<source>\\0<id>`` a hash (receiver, status, payload, times, reason,
response), ``h:<source>\\0<id>`` its history and ``a:<source>\\0<id>`` its attempts (lists of JSON),
``s:<kind>`` the schedule (a sorted set by due time), ``r:<receiver>`` the rate limit's
theoretical arrival time, ``f`` the FAILED messages (a sorted set by the time they failed, in
whole microseconds as the listing), ``receivers`` the receivers' disabled flags (a hash by
name). The DONE messages ``purge`` forgets are the listing's ``l:DONE``, by the time they got
there (a set ``d`` of them once repeated it: a store's first purge deletes it).

The listing (``messages``, ``counts``): every message is a member ``<source>\\0<id>`` of two
sorted sets of its status, scored by its ``updated_at`` in whole microseconds: ``l:<status>``
and ``lr:<receiver>\\0<status>``, moved from the old status's sets to the new one's in the
script that changes the status (and removed in the one that purges it); ``lrs`` is the set of
receivers with messages. A page is one rank range per status selected, merged; a receiver's count
in a status is the cardinality of its set. A source is not indexed (as in the SQLite state): its
page walks the ranges of the statuses (and the receiver) selected, keeping its own members (they
start with the source), at most ``WALK`` members a script, as many scripts as the page takes.
Each set is a ZREM and a ZADD at every status change: the two sets of a source (and of a source
and a receiver) that were once kept too doubled the Redis calls of a message's steps.

``lv2`` marks that the messages recorded before the listing existed, or scored in seconds as it
once was, were listed (again), and the sets by source of an older store deleted, on the first
``messages``, ``counts``, ``failed`` or ``purge`` of a store. The scripts name the sets and a
listed message's keys from ``prefix``, which they are given.

Whole microseconds, not seconds with decimals: Redis keeps a small sorted set (up to 128
members, as the sets of the statuses a message passes through mostly are) as a listpack, where
ZADD walks the members comparing scores, reading each back; a whole number is read as it is
stored, one with decimals parsed again each time. At 100 members a ZADD took 22 us with
decimal scores and 5 us with whole ones; the listing's ZADDs were 60% of Redis's time.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson

from headwater.errors import MissingDependencyError
from headwater.webhooks.state.base import (
    Attempt,
    Attempts,
    Claim,
    Cursor,
    InvalidTransition,
    LoopState,
    MessageState,
    ReceiverState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
    Via,
    attempts_of,
    path_to,
    stamped,
    statuses,
)
from headwater.webhooks.state.redis_turns import TurnPipeline

SEP = "\0"
RELIST_BATCH = 500  # messages indexed per script when the listing is first built
WALK = 10_000  # members a listing script walks at most (for a source's page: see the module)
ARRIVE_BATCH, ARRIVE_BATCH_BYTES = 100, 1 << 20  # messages recorded by one script at most

# The listing's sets (see the module's docstring; ``RedisState._listing`` names them too): the
# sets a message of ``receiver`` in ``status`` is in, and moving it between statuses'
# sets (``from`` nil: not listed yet; ``to`` nil: gone). Prepended to the scripts that use it.
_LISTING = (
    "local STATUSES = {"
    + ", ".join(f"'{s.value}'" for s in Status)
    + "}\n"
    + """
local SEP = string.char(0)
local function score(at)  -- seconds (as text) -> whole microseconds (as text): see the module
  return string.format('%.0f', tonumber(at) * 1000000)
end
local function listing(prefix, receiver, status)
  return {prefix .. 'l:' .. status, prefix .. 'lr:' .. receiver .. SEP .. status}
end
local function relist(prefix, receiver, from, to, member, at)
  if from then
    for _, key in ipairs(listing(prefix, receiver, from)) do
      redis.call('ZREM', key, member)
    end
  end
  if to then
    local scored = score(at)
    for _, key in ipairs(listing(prefix, receiver, to)) do
      redis.call('ZADD', key, scored, member)
    end
  end
end
"""
)

# KEYS: receivers with messages; ARGV: prefix, status, now, history entry, then four a message:
# receiver, member of the listing (its keys' name), payload, its first send's claim ('' for
# none: see ``StateStore.arrive_many``). Returns, a message each, 1 when
# recorded, else the message known (its hash, history and attempts): a message twice in the
# batch is recorded once, as it would be by two scripts one after the other.
_ARRIVE = (
    _LISTING
    + """
local prefix, status, now, entry = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local out, told = {}, {}
for i = 5, #ARGV, 4 do
  local receiver, member = ARGV[i], ARGV[i + 1]
  local message, history = prefix .. 'm:' .. member, prefix .. 'h:' .. member
  if redis.call('EXISTS', message) == 1 then
    out[#out + 1] = {redis.call('HGETALL', message), redis.call('LRANGE', history, 0, -1),
                     redis.call('LRANGE', prefix .. 'a:' .. member, 0, -1)}
  else
    local fields = {'receiver', receiver, 'status', status, 'payload', ARGV[i + 2],
                    'created_at', now, 'updated_at', now, 'reason', ''}
    if ARGV[i + 3] ~= '' then
      fields[#fields + 1] = 'sending_until'
      fields[#fields + 1] = ARGV[i + 3]
    end
    redis.call('HSET', message, unpack(fields))
    redis.call('RPUSH', history, entry)
    relist(prefix, receiver, nil, status, member, now)
    if not told[receiver] then
      redis.call('SADD', KEYS[1], receiver)
      told[receiver] = true
    end
    out[#out + 1] = 1
  end
end
return out
"""
)

# KEYS: message hash, history, failed set, attempts; ARGV: status, now, reason (kept when
# FAILED), has response, response, member of the failed set (and the listing), k attempts, prefix,
# '1' to read the message back, n history entries, the entries..., the attempts..., allowed
# previous statuses... Returns the message as it is now (its hash, history and attempts), or only
# 'ok' when not read back.
_ADVANCE = (
    _LISTING
    + """
local found = redis.call('HMGET', KEYS[1], 'status', 'receiver')
local current = found[1]
if not current then return {'missing'} end
local n, k = tonumber(ARGV[10]), tonumber(ARGV[7])
local allowed = false
for i = 11 + n + k, #ARGV do if ARGV[i] == current then allowed = true end end
if not allowed then return {'refused', current} end
-- as few calls as it takes (each costs Redis more than the change it makes)
local fields = {'status', ARGV[1], 'updated_at', ARGV[2], 'reason', ARGV[3]}
if ARGV[4] == '1' then
  fields[#fields + 1] = 'response'
  fields[#fields + 1] = ARGV[5]
end
if k > 0 then  -- an attempt recorded: its send is over
  redis.call('HDEL', KEYS[1], 'sending_until')
end
redis.call('HSET', KEYS[1], unpack(fields))
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 11, 10 + n)) end
relist(ARGV[8], found[2], current, ARGV[1], ARGV[6], ARGV[2])
if k > 0 then redis.call('RPUSH', KEYS[4], unpack(ARGV, 11 + n, 10 + n + k)) end
if ARGV[1] == 'FAILED' then
  redis.call('ZADD', KEYS[3], score(ARGV[2]), ARGV[6])
elseif current == 'FAILED' then
  redis.call('ZREM', KEYS[3], ARGV[6])
end
if ARGV[9] ~= '1' then return {'ok'} end
return {'ok', redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1),
        redis.call('LRANGE', KEYS[4], 0, -1)}
"""
)

# KEYS: message hash, history, attempts. Returns the hash, history and attempts (an empty
# hash: no such message).
_GET = """
local message = redis.call('HGETALL', KEYS[1])
if #message == 0 then return {message, {}, {}} end  -- (the intake's dedup: mostly new ones)
return {message, redis.call('LRANGE', KEYS[2], 0, -1), redis.call('LRANGE', KEYS[3], 0, -1)}
"""

# KEYS: schedule; ARGV: due time, member
_SCHEDULE = """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
return 0
"""

# KEYS: message hash, attempts; ARGV: the attempt
_ATTEMPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[1], 'sending_until')
return 1
"""

# KEYS: schedule; ARGV: now, limit, lease (s; 0: remove)
_TAKE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #due > 0 then
  if tonumber(ARGV[3]) > 0 then
    local until_ = tonumber(ARGV[1]) + tonumber(ARGV[3])
    for _, m in ipairs(due) do redis.call('ZADD', KEYS[1], until_, m) end
  else
    redis.call('ZREM', KEYS[1], unpack(due))
  end
end
return due
"""

# KEYS: schedule; ARGV: member, leased until
_RELEASE = """
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) == tonumber(ARGV[2]) then redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""

# KEYS: message hash, attempts; ARGV: now, until, expected status, expected attempts.
# Returns claimed, interrupted, busy, moved or missing.
_BEGIN_SEND = """
local found = redis.call('HMGET', KEYS[1], 'status', 'sending_until')
local status, mark = found[1], found[2]
if not status then return 'missing' end
if status ~= ARGV[3] or redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[4]) then return 'moved' end
if mark and tonumber(mark) > tonumber(ARGV[1]) then return 'busy' end
redis.call('HSET', KEYS[1], 'sending_until', ARGV[2])
if mark then return 'interrupted' end
return 'claimed'
"""


# GCRA. KEYS: the receiver's key; ARGV: interval (s). Returns the wait in seconds as text. A
# request asked for less than an interval late is counted from when it was due, not from now
# (see ``StateStore.acquire``).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local interval = tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now - interval then tat = now end
if tat > now then return tostring(tat - now) end
redis.call('SET', KEYS[1], tostring(tat + interval), 'PX', math.ceil(interval * 1000) + 60000)
return '0'
"""

# KEYS: the listing's set of DONE messages; ARGV: prefix, before (whole microseconds), limit.
# Returns how many were forgotten.
_PURGE = (
    _LISTING
    + """
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2], 'LIMIT', 0, ARGV[3])
for _, member in ipairs(members) do
  local message = ARGV[1] .. 'm:' .. member
  local found = redis.call('HMGET', message, 'receiver', 'status')
  if not found[1] or found[2] == 'DONE' then  -- (else listed here by mistake: left alone)
    if found[1] then relist(ARGV[1], found[1], found[2], nil, member, 0) end
    redis.call('DEL', message, ARGV[1] .. 'h:' .. member, ARGV[1] .. 'a:' .. member)
  end
  redis.call('ZREM', KEYS[1], member)
end
return #members
"""
)

# KEYS: the listing's set of each status selected; ARGV: prefix, limit, '1' with a cursor,
# the cursor's updated_at (whole microseconds), its member, the members' start wanted ('' any:
# a source and SEP), the most members to walk. Returns the page (member, hash, history,
# attempts each) and where a walk stopped short ({} none, else its score and member: the
# page holds what comes before it, and the next page starts after it). Each set walks at most
# that many members, so a page goes on from where the last script stopped.
_MESSAGES = """
local function less(a, b)  -- by bytes, as the sets order members (Lua's < follows the locale)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function newer(a, b)  -- {score, member, score as text}: a comes first in a page
  if a[1] ~= b[1] then return a[1] > b[1] end
  return less(b[2], a[2])
end
local limit = tonumber(ARGV[2])
local wanted = ARGV[6]
local found = {}
local stop = nil  -- the newest place a walk stopped short
for _, key in ipairs(KEYS) do
  local first = 0
  if ARGV[3] == '1' then
    -- past the members that come before the cursor: the later scores, then those of its
    -- score (in descending byte order) down to its member, found by bisection
    first = redis.call('ZCOUNT', key, '(' .. ARGV[4], '+inf')
    local last = first + redis.call('ZCOUNT', key, ARGV[4], ARGV[4])
    while first < last do
      local mid = math.floor((first + last) / 2)
      if less(redis.call('ZREVRANGE', key, mid, mid)[1], ARGV[5]) then
        last = mid
      else
        first = mid + 1
      end
    end
  end
  local kept, last, budget = 0, nil, tonumber(ARGV[7])  -- (each key's: each walks some)
  while kept < limit do
    local chunk = limit - kept
    if wanted ~= '' then chunk = math.min(1000, budget) end
    if chunk <= 0 then  -- the walk's budget is spent: the page stops here
      if last and (not stop or newer(last, stop)) then stop = last end
      break
    end
    local rows = redis.call('ZREVRANGE', key, first, first + chunk - 1, 'WITHSCORES')
    for i = 1, #rows, 2 do
      last = {tonumber(rows[i + 1]), rows[i], rows[i + 1]}
      if wanted == '' or string.sub(rows[i], 1, #wanted) == wanted then
        found[#found + 1] = last
        kept = kept + 1
        if kept >= limit then break end
      end
    end
    if wanted ~= '' then budget = budget - #rows / 2 end
    first = first + #rows / 2
    if #rows / 2 < chunk then break end  -- the set's end
  end
end
table.sort(found, newer)
local page = {}
for i = 1, math.min(limit, #found) do
  local at = found[i]
  if stop and newer(stop, at) then break end  -- past where a walk stopped: the next page's
  local member = at[2]
  page[i] = {member, redis.call('HGETALL', ARGV[1] .. 'm:' .. member),
             redis.call('LRANGE', ARGV[1] .. 'h:' .. member, 0, -1),
             redis.call('LRANGE', ARGV[1] .. 'a:' .. member, 0, -1)}
end
if stop then return {page, {stop[3], stop[2]}} end
return {page, {}}
"""

# KEYS: receivers with messages; ARGV: prefix, '1' for one receiver, the receiver. Returns a row
# per receiver: its name, then its count in each of STATUSES.
_COUNTS = (
    _LISTING
    + """
local receivers = {ARGV[3]}
if ARGV[2] ~= '1' then receivers = redis.call('SMEMBERS', KEYS[1]) end
local rows = {}
for _, receiver in ipairs(receivers) do
  local row = {receiver}
  for _, status in ipairs(STATUSES) do
    row[#row + 1] = redis.call('ZCARD', ARGV[1] .. 'lr:' .. receiver .. SEP .. status)
  end
  rows[#rows + 1] = row
end
return rows
"""
)

# KEYS: receivers with messages, failed set; ARGV: prefix, members... Lists each
# message where its hash says (out of any other status's sets), scored in whole microseconds:
# recorded before the listing existed, scored in seconds as it once was, or listed already.
_RELIST = (
    _LISTING
    + """
for i = 2, #ARGV do
  local member = ARGV[i]
  local found = redis.call('HMGET', ARGV[1] .. 'm:' .. member, 'receiver', 'status', 'updated_at')
  if found[1] then
    for _, status in ipairs(STATUSES) do
      if status ~= found[2] then relist(ARGV[1], found[1], status, nil, member, 0) end
    end
    relist(ARGV[1], found[1], nil, found[2], member, found[3])
    redis.call('SADD', KEYS[1], found[1])
    if found[2] == 'FAILED' then redis.call('ZADD', KEYS[2], score(found[3]), member) end
  end
end
return 0
"""
)


def _load_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise MissingDependencyError("redis", "redis") from exc
    return redis


def _decode(
    source_id: str,
    message_id: str,
    fields: dict[bytes, bytes],
    transitions: list[bytes],
    tries: list[bytes],
) -> MessageState:
    response = fields.get(b"response")
    return MessageState(
        source_id=source_id,
        message_id=message_id,
        receiver=fields[b"receiver"].decode(),
        status=_STATUS[fields[b"status"]],
        payload=bytes(fields[b"payload"]),
        created_at=float(fields[b"created_at"]),
        updated_at=float(fields[b"updated_at"]),
        reason=fields.get(b"reason", b"").decode(),
        response=bytes(response) if response is not None else None,
        history=tuple(Transition(Status(s), t, r) for s, t, r in map(orjson.loads, transitions)),
        attempts=tuple(Attempt(**orjson.loads(a)) for a in tries),
    )


def _message(source_id: str, message_id: str, found: list[Any]) -> MessageState | None:
    """A message from a script's ``{hash as a flat list, history, attempts}`` (None: the hash
    is empty, no such message)."""
    flat, transitions, tries = found
    if not flat:
        return None
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    return _decode(source_id, message_id, fields, transitions, tries)


_STATUS = {s.value.encode(): s for s in Status}
T = TypeVar("T")
# a script run: (the script, its keys, its arguments)
Call = tuple[Any, list[Any], list[Any]]
# a step: the script it runs and what the script's answer means
Step = tuple[Call, Callable[[Any], T]]


def _glob(head: bytes) -> bytes:
    """A SCAN pattern of the keys that start with ``head``."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", head) + b"*"


def _batches(
    messages: Sequence[tuple[str, str, str, bytes, str]],
) -> Iterator[Sequence[tuple[str, str, str, bytes, str]]]:
    """``messages`` in runs of at most ``ARRIVE_BATCH`` of them and (but for one larger
    message) ``ARRIVE_BATCH_BYTES`` of payloads."""
    start, size = 0, 0
    for i, message in enumerate(messages):
        if i > start and (i - start >= ARRIVE_BATCH or size + len(message[3]) > ARRIVE_BATCH_BYTES):
            yield messages[start:i]
            start, size = i, 0
        size += len(message[3])
    if start < len(messages):
        yield messages[start:]


def _chunks(items: Iterable[T], n: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _score(at: float) -> str:
    """A time as the sorted sets score it: whole microseconds (rounded as the scripts'
    ``score`` rounds; see the module)."""
    return f"{at * 1e6:.0f}"


def _split(member: bytes) -> tuple[str, str]:
    source_id, message_id = member.decode().split(SEP, 1)
    return source_id, message_id


class RedisState(StateStore):
    """Each step the workers take is one script (``*_step``: the script's call and what its
    answer means), run here on the synchronous client, one round trip each, and by
    :meth:`on_loop`'s state with every other step of a turn of the loop, one round trip for
    them all."""

    def __init__(self, url: str, prefix: str = "headwater:webhooks:") -> None:
        self.url = url
        self._redis = _load_redis().Redis.from_url(url, decode_responses=False)
        self.prefix = prefix
        self._arrive = self._redis.register_script(_ARRIVE)
        self._get = self._redis.register_script(_GET)
        self._advance = self._redis.register_script(_ADVANCE)
        self._attempt = self._redis.register_script(_ATTEMPT)
        self._schedule = self._redis.register_script(_SCHEDULE)
        self._take_due = self._redis.register_script(_TAKE_DUE)
        self._release = self._redis.register_script(_RELEASE)
        self._begin_send = self._redis.register_script(_BEGIN_SEND)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._purge = self._redis.register_script(_PURGE)
        self._messages = self._redis.register_script(_MESSAGES)
        self._counts = self._redis.register_script(_COUNTS)
        self._relist = self._redis.register_script(_RELIST)
        self._listed = False  # the messages from before the listing are known to be in it
        self._purged = False  # this store purged once (an older store's ``d`` is gone)
        self.walk = WALK
        self.scripts = [self._arrive, self._get, self._advance, self._attempt, self._schedule]
        self.scripts += [self._take_due, self._release, self._begin_send, self._acquire]

    def message_key(self, source_id: str, message_id: str) -> str:
        """The key of the message's hash."""
        return f"{self.prefix}m:{source_id}{SEP}{message_id}"

    def _keys(self, source_id: str, message_id: str) -> tuple[str, str, str]:
        name = f"{source_id}{SEP}{message_id}"
        return (f"{self.prefix}m:{name}", f"{self.prefix}h:{name}", f"{self.prefix}a:{name}")

    def _do(self, step: Step[T]) -> T:
        (script, keys, args), done = step
        return done(script(keys=keys, args=args))

    # -- the steps: each one script ------------------------------------------------------------
    def arrive_steps(
        self,
        messages: Sequence[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[Step[list[tuple[bool, MessageState]]]]:
        """The arrival of ``messages`` (source, id, receiver, payload; each claimed for its
        first send as ``claims`` says, see ``StateStore.arrive_many``): a script a batch of at
        most ``ARRIVE_BATCH`` messages or ``ARRIVE_BATCH_BYTES`` of payloads (Redis runs
        nothing else during a script), each answering for its messages in order."""
        entry = orjson.dumps([Status.ARRIVED.value, now, ""])
        head = [self.prefix, Status.ARRIVED.value, repr(now), entry]
        keys = [f"{self.prefix}lrs"]
        steps: list[Step[list[tuple[bool, MessageState]]]] = []
        claimed = [
            (*m, "" if c is None else repr(c))
            for m, c in zip(messages, claims or [None] * len(messages), strict=True)
        ]
        for batch in _batches(claimed):

            def done(
                answers: Any, batch: Sequence[tuple[str, str, str, bytes, str]] = batch
            ) -> list[tuple[bool, MessageState]]:
                out = []
                for (source_id, message_id, receiver, payload, _), answer in zip(
                    batch, answers, strict=True
                ):
                    if answer == 1:
                        state = MessageState.arrived(source_id, message_id, receiver, payload, now)
                        out.append((True, state))
                    else:
                        known = _message(source_id, message_id, answer)
                        assert known is not None
                        out.append((False, known))
                return out

            args: list[Any] = list(head)
            for source_id, message_id, receiver, payload, claim in batch:
                args += (receiver, f"{source_id}{SEP}{message_id}", payload, claim)
            steps.append(((self._arrive, keys, args), done))
        return steps

    def get_step(self, source_id: str, message_id: str) -> Step[MessageState | None]:
        def done(answer: Any) -> MessageState | None:
            return _message(source_id, message_id, answer)

        return (self._get, list(self._keys(source_id, message_id)), []), done

    def advance_step(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        retry: bool = False,
        attempt: Attempts = None,
        read_back: bool = True,
        via_at: float | None = None,
    ) -> Step[MessageState | None]:
        """(``read_back``: the message as it is now, else None.)"""
        message, history, attempts = self._keys(source_id, message_id)
        allowed, _ = path_to(status, via, retry)
        passed = stamped(status, via, now, via_at)
        entries = [orjson.dumps([step.value, at, reason]) for step, at in passed]
        kept = reason if status is Status.FAILED else ""
        tried = [orjson.dumps(a.__dict__) for a in attempts_of(attempt)]
        args: list[Any] = [status.value, repr(now), kept, "1" if response else "0"]
        args += [response or b"", f"{source_id}{SEP}{message_id}", len(tried), self.prefix]
        args += ["1" if read_back else "0", len(entries), *entries, *tried]
        args += [s.value for s in allowed]
        keys = [message, history, f"{self.prefix}f", attempts]

        def done(outcome: Any) -> MessageState | None:
            verdict = outcome[0]
            if verdict == b"missing":
                raise UnknownMessage(f"no message {source_id}/{message_id}")
            if verdict == b"refused":
                current = Status(outcome[1].decode())
                raise InvalidTransition((source_id, message_id), current, status)
            return _message(source_id, message_id, outcome[1:]) if read_back else None

        return (self._advance, keys, args), done

    def attempt_step(self, source_id: str, message_id: str, attempt: Attempt) -> Step[None]:
        message, _, attempts = self._keys(source_id, message_id)

        def done(answer: Any) -> None:
            if not answer:
                raise UnknownMessage(f"no message {source_id}/{message_id}")

        return (self._attempt, [message, attempts], [orjson.dumps(attempt.__dict__)]), done

    def schedule_step(
        self, kind: str, source_id: str, message_id: str, due_at: float
    ) -> Step[None]:
        member = f"{source_id}{SEP}{message_id}"
        return (self._schedule, [f"{self.prefix}s:{kind}"], [repr(due_at), member]), _nothing

    def take_due_step(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> Step[list[tuple[str, str]]]:
        args = [repr(now), limit, repr(lease_s)]
        return (self._take_due, [f"{self.prefix}s:{kind}"], args), _members

    def release_step(
        self, kind: str, source_id: str, message_id: str, leased_until: float
    ) -> Step[None]:
        args = [f"{source_id}{SEP}{message_id}", repr(leased_until)]
        return (self._release, [f"{self.prefix}s:{kind}"], args), _nothing

    def begin_send_step(self, state: MessageState, now: float, until: float) -> Step[Claim]:
        message, _, attempts = self._keys(*state.key)
        args = [repr(now), repr(until), state.status.value, len(state.attempts)]

        def done(answer: Any) -> Claim:
            if answer == b"missing":
                raise UnknownMessage(f"no message {state.source_id}/{state.message_id}")
            return Claim(answer.decode())

        return (self._begin_send, [message, attempts], args), done

    def acquire_step(self, receiver: str, requests: int, per_s: float) -> Step[float]:
        keys = [f"{self.prefix}r:{receiver}"]
        return (self._acquire, keys, [repr(per_s / requests)]), float

    # -- the store's methods: each step on its own ---------------------------------------------
    def arrive(
        self, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> tuple[bool, MessageState]:
        return self.arrive_many([(source_id, message_id, receiver, payload)], now)[0]

    def arrive_many(
        self,
        messages: list[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[tuple[bool, MessageState]]:
        """A script a batch (see ``arrive_steps``), all of them in one round trip."""
        steps = self.arrive_steps(messages, now, claims)
        pipe = self._redis.pipeline(transaction=False)
        for (script, keys, args), _ in steps:
            script(keys=keys, args=args, client=pipe)
        answers = pipe.execute()
        return [row for (_, done), a in zip(steps, answers, strict=True) for row in done(a)]

    def known(self, source_id: str, message_id: str) -> bool:
        return bool(self._redis.exists(self.message_key(source_id, message_id)))

    def get(self, source_id: str, message_id: str) -> MessageState | None:
        return self._do(self.get_step(source_id, message_id))

    def advance(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Status | None = None,
        retry: bool = False,
        attempt: Attempt | None = None,
    ) -> MessageState:
        moved = self._do(
            self.advance_step(
                source_id,
                message_id,
                status,
                now,
                reason=reason,
                response=response,
                via=via,
                retry=retry,
                attempt=attempt,
            )
        )
        assert moved is not None
        return moved

    def move(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        return self._do(
            self.move_step(
                state, status, now, reason=reason, response=response, via=via, via_at=via_at,
                attempt=attempt,
            )
        )  # fmt: skip

    def move_step(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> Step[MessageState]:
        """``advance_step``, not read back: it answers ``state.moved`` (``StateStore.move``)."""
        call, checked = self.advance_step(
            *state.key, status, now, reason=reason, response=response, via=via, attempt=attempt,
            read_back=False, via_at=via_at,
        )  # fmt: skip

        def done(answer: Any) -> MessageState:
            checked(answer)  # (refused, unknown: raised)
            return state.moved(
                status, now, reason=reason, response=response, via=via, via_at=via_at,
                attempt=attempt,
            )  # fmt: skip

        return call, done

    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        self._do(self.attempt_step(source_id, message_id, attempt))

    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        self._do(self.schedule_step(kind, source_id, message_id, due_at))

    def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        return self._do(self.take_due_step(kind, now, limit, lease_s))

    def release(self, kind: str, source_id: str, message_id: str, leased_until: float) -> None:
        self._do(self.release_step(kind, source_id, message_id, leased_until))

    def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        return self._do(self.begin_send_step(state, now, until))

    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        return self._do(self.acquire_step(receiver, requests, per_s))

    def on_loop(self) -> LoopState:
        if urlsplit(self.url).scheme != "redis":  # TLS, a Unix socket: redis-py's, one by one
            return LoopState(self)
        return RedisLoopState(self)

    def failed(
        self, receiver: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[MessageState]:
        self._list_existing()
        low = "-inf" if since is None else _score(since)
        out: list[MessageState] = []
        for member in self._redis.zrangebyscore(f"{self.prefix}f", low, "+inf"):
            state = self.get(*_split(member))
            if state is not None and receiver in (None, state.receiver):
                out.append(state)
                if len(out) >= limit:
                    break
        return out

    def messages(
        self,
        source_id: str | None,
        status: str | None,
        receiver: str | None,
        limit: int,
        before: Cursor | None = None,
    ) -> list[MessageState]:
        keys = [self._listing(receiver, s) for s in statuses(status)]
        if limit <= 0:
            return []
        self._list_existing()
        wanted = "" if source_id is None else f"{source_id}{SEP}"
        after: list[Any] = ["0", "", ""]
        if before is not None:
            at, after_source, after_message = before
            after = ["1", _score(float(at)), f"{after_source}{SEP}{after_message}"]
        page: list[MessageState] = []
        while len(page) < limit:  # (more than one script: a source's walk stopped short)
            args = [self.prefix, limit - len(page), *after, wanted, self.walk]
            rows, stop = self._messages(keys=keys, args=args)
            for member, flat, transitions, tries in rows:
                if flat:  # always, but for a message purged by a worker from before the listing
                    fields = dict(zip(flat[::2], flat[1::2], strict=True))
                    page.append(_decode(*_split(member), fields, transitions, tries))
            if not stop:
                break
            after = ["1", *stop]
        return page

    def counts(self, receiver: str | None = None) -> dict[str, dict[str, int]]:
        self._list_existing()
        args = [self.prefix, "0", ""] if receiver is None else [self.prefix, "1", receiver]
        out: dict[str, dict[str, int]] = {}
        for name, *by_status in self._counts(keys=[f"{self.prefix}lrs"], args=args):
            if any(by_status):  # a receiver whose messages were all purged is left out
                out[name.decode()] = {s.value: n for s, n in zip(Status, by_status, strict=True)}
        return out

    def _listing(self, receiver: str | None, status: Status) -> str:
        """The sorted set of the messages in ``status`` (of ``receiver``)."""
        if receiver is None:
            return f"{self.prefix}l:{status.value}"
        return f"{self.prefix}lr:{receiver}{SEP}{status.value}"

    def _list_existing(self) -> None:
        """List the messages recorded before the listing existed, or scored in seconds as it
        once was, once per store (``lv2`` marks it done); each message in one script, so that
        a worker changing it meanwhile leaves it listed as it is."""
        if self._listed:
            return
        marker = f"{self.prefix}lv2"
        if not self._redis.exists(marker):
            keys = [f"{self.prefix}lrs", f"{self.prefix}f"]
            head = f"{self.prefix}m:".encode()
            found = self._redis.scan_iter(match=_glob(head), count=1000)
            for batch in _chunks((key[len(head) :] for key in found), RELIST_BATCH):
                self._relist(keys=keys, args=[self.prefix, *batch])
            for kind in (b"ls:", b"lsr:"):  # an older store's sets by source
                sets = _glob(f"{self.prefix}".encode() + kind)
                for batch in _chunks(self._redis.scan_iter(match=sets, count=1000), 500):
                    self._redis.delete(*batch)
            self._redis.set(marker, 1)
        self._listed = True

    def purge(self, before: float, limit: int = 1000) -> int:
        self._list_existing()
        if not self._purged:  # the set of DONE messages an older store kept beside l:DONE
            self._redis.unlink(f"{self.prefix}d")
            self._purged = True
        args = [self.prefix, _score(before), limit]
        return int(self._purge(keys=[self._listing(None, Status.DONE)], args=args))

    def set_receiver(self, name: str, disabled: bool, reason: str, now: float) -> None:
        flag = json.dumps({"disabled": disabled, "reason": reason, "at": now})
        self._redis.hset(f"{self.prefix}receivers", name, flag)

    def receivers(self) -> dict[str, ReceiverState]:
        out = {}
        for name, value in self._redis.hgetall(f"{self.prefix}receivers").items():
            flag = json.loads(value)
            out[name.decode()] = ReceiverState(
                name.decode(), flag["disabled"], flag["reason"], flag["at"]
            )
        return out

    def close(self) -> None:
        self._redis.close()


def _nothing(answer: Any) -> None:
    return None


def _members(answer: Any) -> list[tuple[str, str]]:
    return [_split(member) for member in answer]


class RedisLoopState(LoopState):
    """The store's steps from an event loop: every step its tasks take in a turn of the loop
    goes to Redis in one pipeline (:class:`TurnPipeline`), and no step blocks the loop."""

    store: RedisState

    def __init__(self, store: RedisState) -> None:
        super().__init__(store)
        self._turns = TurnPipeline(store.url, store.scripts)

    async def _do(self, step: Step[T]) -> T:
        call, done = step
        return done(await self._turns.run(*call))

    async def get(self, source_id: str, message_id: str) -> MessageState | None:
        return await self._do(self.store.get_step(source_id, message_id))

    async def lookup(self, source_id: str, message_id: str) -> MessageState | None:
        message = self.store.message_key(source_id, message_id)
        if not await self._turns.command(b"EXISTS", message):  # (no script: mostly new ones)
            return None
        return await self.get(source_id, message_id)

    async def arrive_many(
        self,
        messages: list[tuple[str, str, str, bytes]],
        now: float,
        claims: Sequence[float | None] | None = None,
    ) -> list[tuple[bool, MessageState]]:
        steps = [self._do(step) for step in self.store.arrive_steps(messages, now, claims)]
        return [row for rows in await asyncio.gather(*steps) for row in rows]

    async def move(
        self,
        state: MessageState,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
        via: Via = None,
        via_at: float | None = None,
        attempt: Attempts = None,
    ) -> MessageState:
        return await self._do(
            self.store.move_step(
                state, status, now, reason=reason, response=response, via=via, via_at=via_at,
                attempt=attempt,
            )
        )  # fmt: skip

    async def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        await self._do(self.store.attempt_step(source_id, message_id, attempt))

    async def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        await self._do(self.store.schedule_step(kind, source_id, message_id, due_at))

    async def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        return await self._do(self.store.take_due_step(kind, now, limit, lease_s))

    async def release(
        self, kind: str, source_id: str, message_id: str, leased_until: float
    ) -> None:
        await self._do(self.store.release_step(kind, source_id, message_id, leased_until))

    async def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        return await self._do(self.store.begin_send_step(state, now, until))

    async def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        return await self._do(self.store.acquire_step(receiver, requests, per_s))

    async def flush(self) -> None:
        return None  # a step's change is made when its caller has its answer

    async def close(self) -> None:
        await self._turns.close()
