"""The Redis state from the workers' event loop (``RedisLoopState`` over ``TurnPipeline``), on a
real Redis: the steps a turn's tasks take go in one write and each task gets its own answer or
error; a server that lost its scripts has them loaded again; a connection Redis closes fails
what was on it, and the next step connects again; the commands are RESP as Redis reads it."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from headwater.testing.redis import RedisService
from headwater.webhooks.state import Status
from headwater.webhooks.state.base import InvalidTransition
from headwater.webhooks.state.redis import RedisLoopState, RedisState
from headwater.webhooks.state.redis_turns import ConnectionLost, encode


@pytest.fixture
def store(redis_service: RedisService) -> RedisState:
    state = RedisState(redis_service.url, prefix=f"turns:{uuid.uuid4().hex[:8]}:")
    yield state  # type: ignore[misc]
    state.close()


def test_a_turns_steps_go_in_one_write_and_each_gets_its_answer(store: RedisState) -> None:
    async def go() -> None:
        state = store.on_loop()
        assert isinstance(state, RedisLoopState)
        writes = 0
        original = state._turns._write

        def counting(protocol, batch):  # type: ignore[no-untyped-def]
            nonlocal writes
            writes += 1
            original(protocol, batch)

        state._turns._write = counting  # type: ignore[method-assign]
        messages = [("s", f"m{i}", "ci", b'{"n":%d}' % i) for i in range(200)]
        arrived = await state.arrive_many(messages, 1.0)
        assert [created for created, _ in arrived] == [True] * 200
        assert writes == 1
        # 200 reads at once, one of them of a message that is not there
        found = await asyncio.gather(*(state.get("s", f"m{i}") for i in range(201)))
        assert writes == 2
        assert [f.payload for f in found[:200]] == [m[3] for m in messages]
        assert found[200] is None
        # a refused step fails its own task only
        moved = await state.move(found[0], Status.FAILED, 2.0, reason="r")  # type: ignore[arg-type]
        results = await asyncio.gather(
            state.move(moved, Status.DONE, 3.0),
            state.move(found[1], Status.DELIVERED_TO_RECEIVER, 3.0),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        assert isinstance(results[0], InvalidTransition)
        assert results[1].status is Status.DELIVERED_TO_RECEIVER  # type: ignore[union-attr]
        assert store.get("s", "m1").status is Status.DELIVERED_TO_RECEIVER  # type: ignore[union-attr]
        await state.close()

    asyncio.run(go())


def test_scripts_lost_by_the_server_are_loaded_again(
    store: RedisState, redis_service: RedisService
) -> None:
    async def go() -> None:
        state = store.on_loop()
        await state.arrive_many([("s", "a", "ci", b"{}")], 1.0)
        redis.Redis.from_url(redis_service.url).script_flush()
        got = await asyncio.gather(*(state.get("s", "a") for _ in range(5)))
        assert all(g is not None and g.message_id == "a" for g in got)
        await state.close()

    asyncio.run(go())


def test_a_closed_connection_fails_its_steps_and_the_next_connects(
    store: RedisState, redis_service: RedisService
) -> None:
    async def go() -> None:
        state = store.on_loop()
        await state.arrive_many([("s", "a", "ci", b"{}")], 1.0)
        admin = redis.Redis.from_url(redis_service.url)
        admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(ConnectionLost):
            await asyncio.gather(*(state.get("s", "a") for _ in range(3)))
        again = await state.get("s", "a")
        assert again is not None and again.status is Status.ARRIVED
        await state.close()

    asyncio.run(go())


def test_commands_are_resp_as_redis_reads_them(redis_service: RedisService) -> None:
    assert encode(b"SET", "k", 5, 1.5) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n$3\r\n1.5\r\n"
    assert encode(Status.DONE, bytearray(b"x")) == b"*2\r\n$4\r\nDONE\r\n$1\r\nx\r\n"
    with pytest.raises(TypeError, match="not NoneType"):
        encode(b"SET", None)  # type: ignore[arg-type]

    async def go() -> list[bytes]:
        reader, writer = await asyncio.open_connection(redis_service.host, redis_service.port)
        key = f"turns:{uuid.uuid4().hex}"
        value = "é\r\n\x00" * 3  # UTF-8, CRLF and NUL inside a bulk string
        writer.write(encode(b"SET", key, value) + encode(b"GET", key) + encode(b"DEL", key))
        await writer.drain()
        replies = [await reader.readline(), await reader.readline()]
        replies.append(await reader.readexactly(len(value.encode()) + 2))
        replies.append(await reader.readline())
        writer.close()
        return replies

    ok, size, body, deleted = asyncio.run(go())
    assert ok == b"+OK\r\n" and size == b"$%d\r\n" % len(("é\r\n\x00" * 3).encode())
    assert body.decode()[:-2] == "é\r\n\x00" * 3 and deleted == b":1\r\n"
