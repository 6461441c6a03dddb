"""Errors raised by the bus (both backends raise the same ones)."""

from __future__ import annotations

from headwater.errors import TerminalError, TransientError


class BusError(TerminalError):
    code = "HW-BUS-000"


class InvalidTopicName(BusError):
    code = "HW-BUS-001"


class UnknownTopic(BusError):
    code = "HW-BUS-002"


class UnknownPartition(BusError):
    code = "HW-BUS-003"


class OffsetOutOfRange(BusError):
    code = "HW-BUS-004"


class RecordTooLarge(BusError):
    code = "HW-BUS-005"
    index: int = -1  #: which record of the batch
    size: int = 0  #: its size in bytes


class TopicExists(BusError):
    code = "HW-BUS-006"


class LogLocked(BusError):
    """Another process holds the write lock of the log directory."""

    code = "HW-BUS-007"


class CorruptLog(BusError):
    """A batch before the tail of a segment failed its checksum or framing."""

    code = "HW-BUS-008"


class BusClosed(BusError):
    code = "HW-BUS-009"


class InvalidArgument(BusError):
    code = "HW-BUS-010"


class BusUnavailable(TransientError):
    """The bus cannot take the append now (I/O error, broker down, queue full)."""

    code = "HW-BUS-100"


class QueueFull(BusUnavailable):
    """The backend's write queue cannot take the append now; nothing of it was queued.
    ``needed`` is what the append asks of the queue in the backend's unit (bytes on the
    embedded log, messages on Kafka's producer). ``headwater.bus.waiting`` waits for room."""

    code = "HW-BUS-101"

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed
