"""The webhook state in Redis (the seed's choice), shared by webhook workers on any number of
processes and machines. Every step that reads and then writes is one Lua script, so it is atomic
on the server; the rate limit's clock is the server's (``TIME``), the same for every worker.

Keys (under ``prefix``): ``m:<source>\\0<id>`` a hash (receiver, status, payload, times, reason,
response), ``h:<source>\\0<id>`` its history and ``a:<source>\\0<id>`` its attempts (lists of JSON),
``s:<kind>`` the schedule (a sorted set by due time), ``r:<receiver>`` the rate limit's
theoretical arrival time, ``f`` the FAILED messages and ``d`` the DONE ones (sorted sets by the
time they got there),
``receivers`` the receivers' disabled flags (a hash by name).
"""

from __future__ import annotations

import json
from typing import Any

from headwater.errors import MissingDependencyError
from headwater.webhooks.state.base import (
    Attempt,
    Claim,
    InvalidTransition,
    MessageState,
    ReceiverState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
    path_to,
)

SEP = "\0"

# KEYS: message hash, history; ARGV: receiver, status, payload, now, history entry
_ARRIVE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'receiver', ARGV[1], 'status', ARGV[2], 'payload', ARGV[3],
           'created_at', ARGV[4], 'updated_at', ARGV[4], 'reason', '')
redis.call('RPUSH', KEYS[2], ARGV[5])
return 1
"""

# KEYS: message hash, history, failed set, attempts, done set; ARGV: status, now, reason (kept when
# FAILED), has response, response, member of the failed set, an attempt ('' for none),
# n history entries, the entries..., allowed previous statuses... Returns the message as it
# is now (its hash, history and attempts).
_ADVANCE = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {'missing'} end
local n = tonumber(ARGV[8])
local allowed = false
for i = 9 + n, #ARGV do if ARGV[i] == current then allowed = true end end
if not allowed then return {'refused', current} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2], 'reason', ARGV[3])
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'response', ARGV[5]) end
for i = 9, 8 + n do redis.call('RPUSH', KEYS[2], ARGV[i]) end
if ARGV[7] ~= '' then
  redis.call('RPUSH', KEYS[4], ARGV[7])
  redis.call('HDEL', KEYS[1], 'sending_until')
end
if ARGV[1] == 'FAILED' then
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[6])
elseif current == 'FAILED' then
  redis.call('ZREM', KEYS[3], ARGV[6])
end
if ARGV[1] == 'DONE' then redis.call('ZADD', KEYS[5], ARGV[2], ARGV[6]) end
return {'ok', redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1),
        redis.call('LRANGE', KEYS[4], 0, -1)}
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
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status ~= ARGV[3] or redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[4]) then return 'moved' end
local mark = redis.call('HGET', KEYS[1], 'sending_until')
if mark and tonumber(mark) > tonumber(ARGV[1]) then return 'busy' end
redis.call('HSET', KEYS[1], 'sending_until', ARGV[2])
if mark then return 'interrupted' end
return 'claimed'
"""


# GCRA. KEYS: the receiver's key; ARGV: interval (s). Returns the wait in seconds as text.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
if tat > now then return tostring(tat - now) end
local interval = tonumber(ARGV[1])
redis.call('SET', KEYS[1], tostring(tat + interval), 'PX', math.ceil(interval * 1000) + 60000)
return '0'
"""


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
    text = {k.decode(): v for k, v in fields.items()}
    return MessageState(
        source_id=source_id,
        message_id=message_id,
        receiver=text["receiver"].decode(),
        status=Status(text["status"].decode()),
        payload=bytes(text["payload"]),
        created_at=float(text["created_at"]),
        updated_at=float(text["updated_at"]),
        reason=text.get("reason", b"").decode(),
        response=bytes(text["response"]) if "response" in text else None,
        history=tuple(Transition(Status(s), t, r) for s, t, r in map(json.loads, transitions)),
        attempts=tuple(Attempt(**json.loads(a)) for a in tries),
    )


def _split(member: bytes) -> tuple[str, str]:
    source_id, message_id = member.decode().split(SEP, 1)
    return source_id, message_id


class RedisState(StateStore):
    def __init__(self, url: str, prefix: str = "headwater:webhooks:") -> None:
        self._redis = _load_redis().Redis.from_url(url, decode_responses=False)
        self.prefix = prefix
        self._arrive = self._redis.register_script(_ARRIVE)
        self._advance = self._redis.register_script(_ADVANCE)
        self._attempt = self._redis.register_script(_ATTEMPT)
        self._take_due = self._redis.register_script(_TAKE_DUE)
        self._release = self._redis.register_script(_RELEASE)
        self._begin_send = self._redis.register_script(_BEGIN_SEND)
        self._acquire = self._redis.register_script(_ACQUIRE)

    def _keys(self, source_id: str, message_id: str) -> tuple[str, str, str]:
        name = f"{source_id}{SEP}{message_id}"
        return (f"{self.prefix}m:{name}", f"{self.prefix}h:{name}", f"{self.prefix}a:{name}")

    def arrive(
        self, source_id: str, message_id: str, receiver: str, payload: bytes, now: float
    ) -> tuple[bool, MessageState]:
        message, history, _ = self._keys(source_id, message_id)
        entry = json.dumps([Status.ARRIVED.value, now, ""])
        args = [receiver, Status.ARRIVED.value, payload, repr(now), entry]
        if self._arrive(keys=[message, history], args=args):
            history_ = (Transition(Status.ARRIVED, now),)
            new = MessageState(
                source_id, message_id, receiver, Status.ARRIVED, payload, now, now, history=history_
            )
            return True, new
        state = self.get(source_id, message_id)
        assert state is not None
        return False, state

    def known(self, source_id: str, message_id: str) -> bool:
        return bool(self._redis.exists(self._keys(source_id, message_id)[0]))

    def get(self, source_id: str, message_id: str) -> MessageState | None:
        message, history, attempts = self._keys(source_id, message_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(message).lrange(history, 0, -1).lrange(attempts, 0, -1)
        fields, transitions, tries = pipe.execute()
        if not fields:
            return None
        return _decode(source_id, message_id, fields, transitions, tries)

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
        message, history, attempts = self._keys(source_id, message_id)
        allowed, steps = path_to(status, via, retry)
        entries = [json.dumps([step.value, now, reason]) for step in steps]
        kept = reason if status is Status.FAILED else ""
        tried = json.dumps(attempt.__dict__) if attempt is not None else ""
        args: list[Any] = [status.value, repr(now), kept, "1" if response else "0"]
        args += [response or b"", f"{source_id}{SEP}{message_id}", tried, len(entries)]
        args += [*entries, *(s.value for s in allowed)]
        keys = [message, history, f"{self.prefix}f", attempts, f"{self.prefix}d"]
        outcome = self._advance(keys=keys, args=args)
        verdict = outcome[0].decode()
        if verdict == "missing":
            raise UnknownMessage(f"no message {source_id}/{message_id}")
        if verdict == "refused":
            raise InvalidTransition((source_id, message_id), Status(outcome[1].decode()), status)
        flat = outcome[1]
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        return _decode(source_id, message_id, fields, outcome[2], outcome[3])

    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        message, _, attempts = self._keys(source_id, message_id)
        if not self._attempt(keys=[message, attempts], args=[json.dumps(attempt.__dict__)]):
            raise UnknownMessage(f"no message {source_id}/{message_id}")

    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        self._redis.zadd(f"{self.prefix}s:{kind}", {f"{source_id}{SEP}{message_id}": due_at})

    def take_due(
        self, kind: str, now: float, limit: int, lease_s: float = 0.0
    ) -> list[tuple[str, str]]:
        due = self._take_due(
            keys=[f"{self.prefix}s:{kind}"], args=[repr(now), limit, repr(lease_s)]
        )
        return [_split(member) for member in due]

    def release(self, kind: str, source_id: str, message_id: str, leased_until: float) -> None:
        self._release(
            keys=[f"{self.prefix}s:{kind}"],
            args=[f"{source_id}{SEP}{message_id}", repr(leased_until)],
        )

    def begin_send(self, state: MessageState, now: float, until: float) -> Claim:
        message, _, attempts = self._keys(*state.key)
        args = [repr(now), repr(until), state.status.value, len(state.attempts)]
        answer = self._begin_send(keys=[message, attempts], args=args).decode()
        if answer == "missing":
            raise UnknownMessage(f"no message {state.source_id}/{state.message_id}")
        return Claim(answer)

    def failed(
        self, receiver: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[MessageState]:
        low = "-inf" if since is None else repr(since)
        out: list[MessageState] = []
        for member in self._redis.zrangebyscore(f"{self.prefix}f", low, "+inf"):
            state = self.get(*_split(member))
            if state is not None and receiver in (None, state.receiver):
                out.append(state)
                if len(out) >= limit:
                    break
        return out

    def purge(self, before: float, limit: int = 1000) -> int:
        done = f"{self.prefix}d"
        members = self._redis.zrangebyscore(done, "-inf", f"({before!r}", start=0, num=limit)
        if not members:
            return 0
        pipe = self._redis.pipeline(transaction=True)
        for member in members:
            pipe.delete(*self._keys(*_split(member)))
        pipe.zrem(done, *members)
        pipe.execute()
        return len(members)

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

    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        wait = self._acquire(keys=[f"{self.prefix}r:{receiver}"], args=[repr(per_s / requests)])
        return float(wait)

    def close(self) -> None:
        self._redis.close()
