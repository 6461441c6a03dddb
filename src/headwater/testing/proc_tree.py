"""The processes a test or benchmark started, as the kernel sees them (``/proc``): a process
tree and the memory it holds."""

from __future__ import annotations

import os
from collections.abc import Collection


def tree_pids(root: int, exclude: Collection[int] = ()) -> list[int]:
    """``root`` and every process descended from it, from /proc, but for ``exclude`` and
    their descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss(pid: int) -> int:
    """Bytes resident in ``pid`` now (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root: int) -> int:
    """Bytes resident in ``root`` and every process descended from it (pages shared between
    them counted in each)."""
    return sum(rss(pid) for pid in tree_pids(root))
