"""The SQLite state's grouped changes (``batch_on``): changes made on the workers' loop are
committed together once per turn of the loop, ``flush`` waits for that commit, a change made on
another thread commits the open group with it, and a step that reads then writes stays atomic
inside a group; and connections opening a new state file at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from headwater.webhooks.state import Status
from headwater.webhooks.state import sqlite as sqlite_state
from headwater.webhooks.state.base import DELIVER
from headwater.webhooks.state.sqlite import SqliteState


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteState]:
    opened = SqliteState(tmp_path / "webhooks.sqlite")
    yield opened
    opened.close()


@contextlib.contextmanager
def grouped(store: SqliteState) -> Iterator[None]:
    """The store's changes on the running loop grouped (as the webhook workers have them)."""
    store.batch_on(asyncio.get_running_loop())
    try:
        yield
    finally:
        store.batch_on(None)


def committed_status(path: Path, message_id: str) -> str | None:
    """The status another process would read (its own connection)."""
    conn = sqlite3.connect(path)
    try:
        row = conn.execute(
            "SELECT status FROM messages WHERE source_id = 'app' AND message_id = ?",
            (message_id,),
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


def test_changes_on_the_loop_commit_together_and_flush_waits_for_them(store: SqliteState) -> None:
    path = store.path

    async def main() -> None:
        with grouped(store):
            store.arrive_many([("app", f"m{i}", "rx", b"{}") for i in range(3)], 1.0)
            store.advance("app", "m0", Status.DELIVERED_TO_RECEIVER, 2.0)
            # made, seen by this store, not committed yet: another process does not see them
            state = store.get("app", "m0")
            assert state is not None and state.status is Status.DELIVERED_TO_RECEIVER
            assert committed_status(path, "m0") is None
            await store.flush()
            assert committed_status(path, "m0") == "DELIVERED_TO_RECEIVER"
            assert committed_status(path, "m2") == "ARRIVED"
            # a later turn opens a new group; nothing to wait for once it is committed
            store.advance("app", "m1", Status.FAILED, 3.0, reason="gone")
            assert committed_status(path, "m1") == "ARRIVED"
            await asyncio.sleep(0)  # one turn: the group is committed without a flush
            await asyncio.sleep(0)
            assert committed_status(path, "m1") == "FAILED"
            await store.flush()

    asyncio.run(main())
    store.arrive("app", "alone", "rx", b"{}", 4.0)  # grouping off: committed at once
    assert committed_status(path, "alone") == "ARRIVED"


def test_a_change_on_another_thread_commits_the_open_group(store: SqliteState) -> None:
    path = store.path

    async def main() -> None:
        with grouped(store):
            store.arrive("app", "loop", "rx", b"{}", 1.0)
            waiting = asyncio.ensure_future(store.flush())
            done = threading.Event()

            def elsewhere() -> None:  # e.g. an operator's retry from the console's thread
                store.schedule(DELIVER, "app", "loop", 5.0)
                # committed when the call returns, with the loop's group before it
                assert committed_status(path, "loop") == "ARRIVED"
                done.set()

            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
            assert done.is_set()
            await asyncio.wait_for(waiting, 5)

    asyncio.run(main())
    assert store.take_due(DELIVER, 10.0, 10) == [("app", "loop")]


def test_another_process_writing_turns_the_groups_off_until_it_stops(
    store: SqliteState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group holds the write lock for the rest of its turn; once another connection (another
    worker process) is seen committing, changes commit alone again, and group again once it
    has been quiet for ``SHARED_S``."""
    monkeypatch.setattr(sqlite_state, "SHARED_S", 0.3)
    path = store.path
    other = SqliteState(path)

    async def main() -> None:
        with grouped(store):
            store.arrive("app", "a", "rx", b"{}", 1.0)
            await store.flush()  # grouped: nobody else has written
            other.arrive("app", "b", "rx", b"{}", 1.0)  # another process commits
            store.arrive("app", "c", "rx", b"{}", 1.0)
            await store.flush()  # this group's commit sees the other's
            store.arrive("app", "d", "rx", b"{}", 1.0)
            assert committed_status(path, "d") == "ARRIVED"  # alone: committed at once
            deadline = asyncio.get_running_loop().time() + 10
            for n in itertools.count():  # quiet for SHARED_S: grouped again
                store.arrive("app", f"e{n}", "rx", b"{}", 1.0)
                if committed_status(path, f"e{n}") is None:
                    break
                assert asyncio.get_running_loop().time() < deadline, "never grouped again"
                await asyncio.sleep(0.05)
            await store.flush()
            assert committed_status(path, f"e{n}") == "ARRIVED"

    try:
        asyncio.run(main())
    finally:
        other.close()


def test_a_read_then_write_step_is_atomic_inside_a_group(store: SqliteState) -> None:
    path = store.path

    async def main() -> None:
        with grouped(store):
            store.arrive("app", "first", "rx", b"{}", 1.0)
            with pytest.raises(RuntimeError), store._tx() as c:  # a step that fails midway
                c.execute("DELETE FROM messages WHERE message_id = 'first'")
                raise RuntimeError("the step failed")
            # the failed step's change is undone; the group's other changes stay
            assert store.get("app", "first") is not None
            store.schedule(DELIVER, "app", "first", 2.0)
            assert store.take_due(DELIVER, 3.0, 10) == [("app", "first")]
            await store.flush()

    asyncio.run(main())
    assert committed_status(path, "first") == "ARRIVED"
    assert store.take_due(DELIVER, 3.0, 10) == []


def test_connections_opening_a_new_state_file_at_once_all_open_it(tmp_path: Path) -> None:
    """``headwater up``'s intake workers open the state together on a new data dir: one of
    them switching the file to WAL made another fail at once ("database is locked"; about one
    start in three under the webhooks benchmark). Threads with connections of their own
    contend for the file as processes do (SQLite's locks are per file, not per process), and
    do not fork a test process that has threads (before the fix: a few opens in 60 rounds
    failed)."""
    for trial in range(60):
        path = tmp_path / f"trial-{trial}" / "webhooks.sqlite"
        barrier = threading.Barrier(4)
        outcomes: list[str] = []
        threads = [
            threading.Thread(target=_open_and_close, args=(path, barrier, outcomes))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert outcomes == ["ok"] * 4, f"trial {trial}: {outcomes}"


def _open_and_close(path: Path, barrier: threading.Barrier, outcomes: list[str]) -> None:
    barrier.wait()
    try:
        SqliteState(path).close()
        outcomes.append("ok")
    except Exception as e:
        outcomes.append(repr(e))
