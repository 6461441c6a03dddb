"""Child process of the crash test: appends with ``always`` durability from several threads and
prints one line per acked record: ``run thread seq index partition offset``."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
from pathlib import Path

from headwater.bus.embedded.backend import EmbeddedBus
from headwater.bus.embedded.config import EmbeddedBusConfig
from headwater.bus.records import Message

CONFIG = EmbeddedBusConfig(durability="always", default_partitions=2, segment_bytes=64 * 1024)


def record_id(run: int, thread: int, seq: int, index: int) -> bytes:
    return f"{run}:{thread}:{seq}:{index}".encode()


def value_for(rid: bytes) -> bytes:
    digest = hashlib.sha256(rid).digest()
    return rid + b"|" + digest * (1 + digest[0] % 8)


def _write_all(data: bytes) -> None:
    """Every byte to stdout: a write to a pipe may take only part of a large buffer (a text
    stream's ``write`` would not write the rest), and the parent parses whole lines."""
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def main() -> None:
    directory, run = Path(sys.argv[1]), int(sys.argv[2])
    bus = EmbeddedBus(directory, CONFIG)
    out = threading.Lock()

    def worker(thread: int) -> None:
        rng = random.Random(run * 100 + thread)
        seq = 0
        while True:
            ids = [record_id(run, thread, seq, i) for i in range(rng.randint(1, 30))]
            messages = [
                Message(value_for(rid), key=rid[-1:] if i % 2 else None, headers=(("id", rid),))
                for i, rid in enumerate(ids)
            ]
            positions = bus.append("t", messages).result(timeout=30)
            lines = "".join(
                f"{rid.decode().replace(':', ' ')} {p.partition} {p.offset}\n"
                for rid, p in zip(ids, positions, strict=True)
            )
            with out:
                _write_all(lines.encode())
            seq += 1

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
