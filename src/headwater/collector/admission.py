"""Admission control: refuse events while the log cannot safely take more.

Budgets are evaluated every ``check_interval_s`` off the request path (free disk under the
embedded log; the largest lag of any writer); ``check`` is then a field read. The bus itself
refuses an append when its write queue is full, which the publisher turns into the same answer.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headwater.bus.base import Bus
from headwater.collector.config import AdmissionConfig
from headwater.collector.errors import unavailable

log = logging.getLogger(__name__)


class Admission:
    def __init__(
        self,
        bus: Bus,
        config: AdmissionConfig,
        log_dir: Path | None,
        on_change: Callable[[str | None], None] | None = None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.log_dir = log_dir
        self.refusal: str | None = None
        self._on_change = on_change

    def check(self) -> None:
        """Raise ``Rejected`` (503 + Retry-After) while a budget is exceeded."""
        if self.refusal is not None:
            raise unavailable(self.refusal, self.config.retry_after_s)

    def evaluate(self) -> str | None:
        """Why events must be refused now, or None."""
        cfg = self.config
        if cfg.min_free_disk_bytes is not None and self.log_dir is not None:
            free = shutil.disk_usage(self.log_dir).free
            if free < cfg.min_free_disk_bytes:
                return (
                    f"the log's disk has {free} bytes free, below the budget of "
                    f"{cfg.min_free_disk_bytes} (collector.admission.min_free_disk_bytes)"
                )
        if cfg.max_lag_records is not None:
            worst, group = self._worst_lag()
            if worst > cfg.max_lag_records:
                return (
                    f"writer {group!r} lags {worst} records, over the budget of "
                    f"{cfg.max_lag_records} (collector.admission.max_lag_records)"
                )
        return None

    def _worst_lag(self) -> tuple[int, str]:
        worst, worst_group = 0, ""
        for group in self.bus.groups():
            for tp, offset in self.bus.committed(group).items():
                lag = self.bus.watermarks(tp.topic, tp.partition)[1] - offset
                if lag > worst:
                    worst, worst_group = lag, group
        return worst, worst_group

    def update(self) -> None:
        try:
            refusal = self.evaluate()
        except Exception as e:  # a failing check must not take intake down; it is logged
            log.warning("admission check failed: %s", e)
            return
        if refusal != self.refusal:
            log.warning("admission: %s", refusal or "events accepted again")
            if self._on_change is not None:
                self._on_change(refusal)
        self.refusal = refusal

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.update)
            await asyncio.sleep(self.config.check_interval_s)


class NoticedAdmission(Admission):
    """An intake worker's admission: the process that holds the log evaluates the budgets and
    tells every worker its refusal (``notice``)."""

    def __init__(self, config: AdmissionConfig, notice: dict[str, Any]) -> None:
        super().__init__(None, config, None)  # type: ignore[arg-type]
        self._notice = notice

    @property  # type: ignore[override]
    def refusal(self) -> str | None:
        return self._notice.get("refusal")

    @refusal.setter
    def refusal(self, value: str | None) -> None:
        pass  # set by the notice only

    async def run(self) -> None:
        await asyncio.Event().wait()
