"""The fingerprint store: answers per row, the same answer when a call runs again, merges that
keep about log2(n) segments, leftovers of a killed merge, and processes sharing one folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from headwater.pipeline.steps.seen_store import SUFFIX, Entries, SeenStore

HOUR = 3600.0


def u64(*values: int) -> np.ndarray:
    return np.array(values, dtype="<u8")


def times(*values: float) -> np.ndarray:
    return np.array(values, dtype="<f8")


def test_the_first_row_of_a_fingerprint_wins_and_a_run_again_answers_the_same(
    tmp_path: Path,
) -> None:
    store = SeenStore(tmp_path)
    fps, ids, ats = u64(1, 2, 1, 1), u64(10, 20, 30, 40), times(5, 6, 7, 4)
    expected = [False, False, True, False]  # 30 repeats 10; 40 came before 10 did
    assert store.seen(fps, ids, ats, HOUR).tolist() == expected
    assert store.seen(fps, ids, ats, HOUR).tolist() == expected
    assert SeenStore(tmp_path).seen(fps, ids, ats, HOUR).tolist() == expected  # a new process


def test_fingerprints_and_ids_use_all_64_bits(tmp_path: Path) -> None:
    big = 2**64 - 5
    fps, ids = u64(big, big, big - 1), u64(big - 2, big - 3, big - 2)
    expected = [False, True, False]
    assert SeenStore(tmp_path).seen(fps, ids, times(1, 2, 3), HOUR).tolist() == expected
    assert SeenStore(tmp_path).seen(fps, ids, times(1, 2, 3), HOUR).tolist() == expected


def test_a_row_without_a_time_takes_no_part(tmp_path: Path) -> None:
    store = SeenStore(tmp_path)
    assert store.seen(u64(1, 1), u64(10, 20), times(np.nan, 5), HOUR).tolist() == [False, False]
    assert store.seen(u64(1), u64(30), times(6), HOUR).tolist() == [True]  # 20 is the first


def test_after_the_window_a_fingerprint_starts_again(tmp_path: Path) -> None:
    store = SeenStore(tmp_path)
    assert store.seen(u64(1), u64(10), times(0), HOUR).tolist() == [False]
    later = u64(1, 1), u64(20, 30), times(2 * HOUR, 2 * HOUR + 1)
    assert store.seen(*later, HOUR).tolist() == [False, True]  # 20 is the first one now
    assert store.seen(u64(1), u64(40), times(10), HOUR).tolist() == [False]  # before 20: kept
    assert store.seen(u64(1), u64(10), times(0), HOUR).tolist() == [False]  # its own entry


def test_merges_keep_about_log2_segments_and_drop_what_is_two_windows_old(
    tmp_path: Path,
) -> None:
    store = SeenStore(tmp_path)
    for call in range(200):
        fps = np.arange(call * 100, call * 100 + 100, dtype="<u8")
        assert not store.seen(fps, fps, np.full(100, float(call)), 1e9).any()
    names = sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}"))
    assert 1 <= len(names) <= 9, names  # log2(200) + 1
    kept = np.concatenate([Entries.read(tmp_path / n).fps for n in names])
    assert sorted(kept.tolist()) == list(range(20_000))  # each once
    again = np.arange(0, 20_000, 7, dtype="<u8")
    assert store.seen(again, again + 1, np.full(len(again), 300.0), 1e9).all()
    # a window of 10: a call at 1,000 as large as all before it merges them, dropping all
    late = np.arange(10**9, 10**9 + 20_000, dtype="<u8")
    store.seen(late, late, np.full(len(late), 1000.0), 10.0)
    kept = np.concatenate([Entries.read(p).fps for p in tmp_path.glob(f"*{SUFFIX}")])
    assert sorted(kept.tolist()) == late.tolist()


def entries(*rows: tuple[int, int, float]) -> Entries:
    fps, ids, ats = zip(*rows, strict=True)
    return Entries(u64(*fps), u64(*ids), times(*ats))


def test_a_merge_killed_before_deleting_its_inputs_leaves_nothing_wrong(tmp_path: Path) -> None:
    def segment(newest: int, oldest: int) -> Path:
        return tmp_path / f"{newest:012d}-{oldest:012d}{SUFFIX}"

    entries((1, 10, 1.0)).write(segment(1, 1))  # an input the merge did not delete
    entries((1, 10, 1.0), (2, 20, 2.0)).write(segment(2, 1))  # the merge's output
    (tmp_path / f".{segment(3, 3).name}.123.tmp").write_bytes(b"half")  # a write cut short
    store = SeenStore(tmp_path)
    assert store.seen(u64(1, 2), u64(11, 20), times(3, 3), HOUR).tolist() == [True, False]
    assert not segment(1, 1).exists()  # covered by the merge: deleted
    assert segment(2, 1).exists()
    assert not list(tmp_path.glob("*.tmp"))  # written under the lock: a leftover is dead


HAMMER = """
import sys
from pathlib import Path
import numpy as np
from headwater.pipeline.steps.seen_store import SeenStore
store, worker, kept = SeenStore(Path(sys.argv[1])), int(sys.argv[2]), []
for call in range(40):
    fps = np.arange(call * 50, call * 50 + 50, dtype="<u8")  # both workers: the same fps
    answer = store.seen(fps, fps * 10 + worker, np.full(50, 1.0), 3600.0)  # their own ids
    kept += fps[~answer].tolist()
print(" ".join(map(str, kept)))
"""


def test_two_processes_on_one_folder_keep_each_fingerprint_once(tmp_path: Path) -> None:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", HAMMER, str(tmp_path), str(w)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in (1, 2)
    ]
    kept = []
    for w in workers:
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 0
        kept += [int(x) for x in out.split()]
    assert sorted(kept) == list(range(2000))  # every fingerprint kept by exactly one of them


def test_a_merge_keeps_one_entry_per_fingerprint_the_newer_one_in_order() -> None:
    from headwater.pipeline.steps.seen_store import _merge

    rng = np.random.default_rng(5)
    for _ in range(50):
        old_fps = np.unique(rng.integers(0, 60, rng.integers(0, 40), dtype="<u8"))
        new_fps = np.unique(rng.integers(0, 60, rng.integers(0, 40), dtype="<u8"))
        older = Entries(old_fps, np.full(len(old_fps), 1, "<u8"), old_fps.astype("<f8"))
        newer = Entries(new_fps, np.full(len(new_fps), 2, "<u8"), new_fps.astype("<f8"))
        merged = _merge(older, newer, 10.0)  # entries at times under 10 go
        expected = {f: 1 for f in old_fps.tolist()} | {f: 2 for f in new_fps.tolist()}
        expected = {f: v for f, v in expected.items() if f >= 10}
        assert merged.fps.tolist() == sorted(expected)
        assert merged.ids.tolist() == [expected[f] for f in sorted(expected)]
