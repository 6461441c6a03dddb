"""The webhook state in Redis (the seed's choice), shared by webhook workers on any number of
processes and machines. Every step that reads and then writes is one Lua script, so it is atomic
on the server; the rate limit's clock is the server's (``TIME``), the same for every worker.

Keys (under ``prefix``): ``m:<source>\\0<id>`` a hash (receiver, status, payload, times, reason,
response), ``h:<source>\\0<id>`` its history and ``a:<source>\\0<id>`` its attempts (lists of JSON),
``s:<kind>`` the schedule (a sorted set by due time), ``r:<receiver>`` the rate limit's
theoretical arrival time.
"""

from __future__ import annotations

import json
from typing import Any

from headwater.errors import MissingDependencyError
from headwater.webhooks.state.base import (
    ALLOWED_FROM,
    Attempt,
    InvalidTransition,
    MessageState,
    StateStore,
    Status,
    Transition,
    UnknownMessage,
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

# KEYS: message hash, history; ARGV: status, now, reason, history entry, has response,
# response, allowed previous statuses...
_ADVANCE = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return {'missing'} end
local allowed = false
for i = 7, #ARGV do if ARGV[i] == current then allowed = true end end
if not allowed then return {'refused', current} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[3]) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'response', ARGV[6]) end
redis.call('RPUSH', KEYS[2], ARGV[4])
return {'ok'}
"""

# KEYS: message hash, attempts; ARGV: the attempt
_ATTEMPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: schedule; ARGV: now, limit
_TAKE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
return due
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


class RedisState(StateStore):
    def __init__(self, url: str, prefix: str = "headwater:webhooks:") -> None:
        self._redis = _load_redis().Redis.from_url(url, decode_responses=False)
        self.prefix = prefix
        self._arrive = self._redis.register_script(_ARRIVE)
        self._advance = self._redis.register_script(_ADVANCE)
        self._attempt = self._redis.register_script(_ATTEMPT)
        self._take_due = self._redis.register_script(_TAKE_DUE)
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
        created = self._arrive(keys=[message, history], args=args)
        state = self.get(source_id, message_id)
        assert state is not None
        return bool(created), state

    def get(self, source_id: str, message_id: str) -> MessageState | None:
        message, history, attempts = self._keys(source_id, message_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(message).lrange(history, 0, -1).lrange(attempts, 0, -1)
        fields, transitions, tries = pipe.execute()
        if not fields:
            return None
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

    def advance(
        self,
        source_id: str,
        message_id: str,
        status: Status,
        now: float,
        *,
        reason: str = "",
        response: bytes | None = None,
    ) -> MessageState:
        message, history, _ = self._keys(source_id, message_id)
        allowed = [s.value for s in ALLOWED_FROM[status]]
        entry = json.dumps([status.value, now, reason])
        args: list[Any] = [status.value, repr(now), reason, entry, "1" if response else "0"]
        args += [response or b"", *allowed]
        outcome = self._advance(keys=[message, history], args=args)
        verdict = outcome[0].decode()
        if verdict == "missing":
            raise UnknownMessage(f"no message {source_id}/{message_id}")
        if verdict == "refused":
            raise InvalidTransition((source_id, message_id), Status(outcome[1].decode()), status)
        state = self.get(source_id, message_id)
        assert state is not None
        return state

    def record_attempt(self, source_id: str, message_id: str, attempt: Attempt) -> None:
        message, _, attempts = self._keys(source_id, message_id)
        if not self._attempt(keys=[message, attempts], args=[json.dumps(attempt.__dict__)]):
            raise UnknownMessage(f"no message {source_id}/{message_id}")

    def schedule(self, kind: str, source_id: str, message_id: str, due_at: float) -> None:
        self._redis.zadd(f"{self.prefix}s:{kind}", {f"{source_id}{SEP}{message_id}": due_at})

    def take_due(self, kind: str, now: float, limit: int) -> list[tuple[str, str]]:
        due = self._take_due(keys=[f"{self.prefix}s:{kind}"], args=[repr(now), limit])
        out = []
        for member in due:
            source_id, message_id = member.decode().split(SEP, 1)
            out.append((source_id, message_id))
        return out

    def acquire(self, receiver: str, requests: int, per_s: float) -> float:
        wait = self._acquire(keys=[f"{self.prefix}r:{receiver}"], args=[repr(per_s / requests)])
        return float(wait)

    def close(self) -> None:
        self._redis.close()
