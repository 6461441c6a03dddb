"""Keeping Delta tables fast to read: compaction of the small files a stream writes (optionally
Z-ordered), and ``vacuum`` of the files no version within the retention needs. Both are delta-rs
operations committed as versions of their own; they never change what the table holds, and run
beside the pipeline's appends (delta-rs resolves them as concurrent transactions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headwater.destinations.delta.config import DeltaOptions

if TYPE_CHECKING:
    from deltalake import DeltaTable

MIB = 1 << 20


@dataclass(frozen=True)
class Maintained:
    """What one table's optimize or vacuum did."""

    table: str
    action: str  # "optimize", "zorder" or "vacuum"
    files_added: int = 0
    files_removed: int = 0
    version: int | None = None  # the table's version after

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def compact(
    dt: DeltaTable,
    options: DeltaOptions,
    partitions: Sequence[Mapping[str, str | None]] = (),
    zorder: Sequence[str] = (),
) -> dict[str, Any]:
    """Rewrite ``dt``'s small files into files of about ``options.target_file_mb``
    (``partitions``: only these partition values; ``zorder``: Z-order their rows by these
    columns); returns delta-rs's metrics."""
    target = options.target_file_mb * MIB
    filters = [[(k, "=", v) for k, v in p.items() if v is not None] for p in partitions]
    runs = [f for f in filters if f] or [None]
    out: dict[str, Any] = {"numFilesAdded": 0, "numFilesRemoved": 0}
    for f in runs:
        if zorder:
            m = dt.optimize.z_order(list(zorder), partition_filters=f, target_size=target)
        else:
            m = dt.optimize.compact(partition_filters=f, target_size=target)
        out["numFilesAdded"] += int(m.get("numFilesAdded", 0))
        out["numFilesRemoved"] += int(m.get("numFilesRemoved", 0))
    return out


def optimize(
    tables: Mapping[str, DeltaTable], options: DeltaOptions, zorder: Sequence[str] | None = None
) -> list[Maintained]:
    """Compact each table (Z-ordered by ``zorder``, else ``options.zorder_by``)."""
    columns = list(zorder if zorder is not None else options.zorder_by)
    out = []
    for name, dt in tables.items():
        m = compact(dt, options, zorder=columns)
        dt.update_incremental()
        action = "zorder" if columns else "optimize"
        out.append(Maintained(name, action, m["numFilesAdded"], m["numFilesRemoved"], dt.version()))
    return out


def vacuum(
    tables: Mapping[str, DeltaTable], retention_hours: int, dry_run: bool
) -> list[Maintained]:
    """Delete the files no version newer than ``retention_hours`` needs (and files never
    committed that are as old); ``dry_run``: only count them."""
    out = []
    for name, dt in tables.items():
        gone = dt.vacuum(  # full: also the files no version ever listed
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=False,
            full=True,
        )
        dt.update_incremental()
        out.append(Maintained(name, "vacuum", files_removed=len(gone), version=dt.version()))
    return out
