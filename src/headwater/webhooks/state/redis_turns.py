"""Redis scripts run from an event loop, a turn's worth in one round trip.

Every script a task of the loop runs during one turn is queued; at the start of the next turn
the queue goes to Redis as one pipeline (``EVALSHA`` each, not a transaction: each script is
atomic by itself), and each task gets its own script's answer, or its error. While
``MAX_IN_FLIGHT`` pipelines are on their way, what is queued waits for one of them to come back,
so under load a pipeline carries whatever the loop's tasks asked for meanwhile: one round trip
for many steps, where the synchronous client takes one per step and blocks the loop for it.

A script Redis does not know (a restarted or flushed server) is loaded, and the scripts that
found it missing run again.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

MAX_IN_FLIGHT = 2
MAX_BATCH = 1024  # scripts in one pipeline

Queued = tuple[Script, list[Any], list[Any], "asyncio.Future[Any]"]


class TurnPipeline:
    """Runs scripts for the loop it is first used on (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        self._client = Redis.from_url(url, decode_responses=False)
        self._queue: list[Queued] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    def run(self, script: Script, keys: list[Any], args: list[Any]) -> asyncio.Future[Any]:
        """The script's answer, once the pipeline it goes in has come back."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        self._queue.append((script, keys, args, answer))
        if not self._scheduled and self._in_flight < MAX_IN_FLIGHT:
            self._scheduled = True
            loop.call_soon(self._send)
        return answer

    def _send(self) -> None:
        self._scheduled = False
        if not self._queue or self._in_flight >= MAX_IN_FLIGHT:
            return
        batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._exchange(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self._queue and self._in_flight < MAX_IN_FLIGHT:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send)

    async def _exchange(self, batch: list[Queued]) -> None:
        try:
            answers = await self._execute(batch)
        except BaseException as e:  # the connection: every script of the batch fails with it
            error = e if isinstance(e, Exception) else ConnectionError("cancelled")
            for *_, answer in batch:
                if not answer.done():
                    answer.set_exception(error)
            if not isinstance(e, Exception):
                raise
        else:
            for (*_, answer), result in zip(batch, answers, strict=True):
                if answer.done():  # its caller was cancelled
                    continue
                if isinstance(result, Exception):
                    answer.set_exception(result)
                else:
                    answer.set_result(result)
        finally:
            self._in_flight -= 1
            if self._queue and not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._send)

    async def _execute(self, batch: list[Queued]) -> list[Any]:
        answers = await self._pipeline(batch)
        missing = [i for i, a in enumerate(answers) if isinstance(a, NoScriptError)]
        if missing:
            for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                await self._client.script_load(script.script)
            again = await self._pipeline([batch[i] for i in missing])
            for i, answer in zip(missing, again, strict=True):
                answers[i] = answer
        return answers

    async def _pipeline(self, batch: list[Queued]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def close(self) -> None:
        """Wait for the pipelines on their way, and close the connections."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()
