"""Helpers shared by headwater's benchmarks (``bench/*.py``): machine facts, CPU meters,
latency percentiles, a plain-text figures table, JSON output, child processes and profiling
(py-spy, when it is installed).

Benchmarks are scripts, not tests: each one stops by itself, talks to loopback only and prints
what it measured. Progress goes to stderr so that ``--format json`` keeps stdout clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headwater.testing.proc_tree import rss, tree_pids

if TYPE_CHECKING:
    from headwater.testing.kafka import KafkaCluster

MB = 1_000_000  # throughput figures are in decimal megabytes (10^6 bytes) per second
MiB = 1 << 20
# The JVM of the Apache Kafka brokers the benchmarks start (headwater.testing.kafka): the
# broker's usual collector, C2 on (the tests' default is a small C1-only JVM)
KAFKA_JVM = ("-Xms256m", "-Xmx1g", "-XX:+UseG1GC")


# -- progress and output ----------------------------------------------------------------------
def progress(message: str) -> None:
    """One line of progress on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], *, markdown: bool = False
) -> str:
    """A table with right-aligned cells (left-aligned first column), plain or Markdown."""
    cells = [[str(h) for h in headers], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts).rstrip()

    out = [line(cells[0])]
    if markdown:
        rules = [("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)]
        out.append("|" + "|".join(rules) + "|")
    else:
        out.append("  ".join("-" * w for w in widths))
    out += [line(row) for row in cells[1:]]
    return "\n".join(out)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt_number(value)
    return str(value)


def fmt_number(value: float) -> str:
    """Three significant figures, thousands separated: 1,234,000 / 56.7 / 0.123."""
    if value != value:  # NaN
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{round(value):,}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def emit_json(document: object) -> None:
    json.dump(document, sys.stdout, indent=2, default=_json_default)
    sys.stdout.write("\n")


def output(fmt: str, document: Callable[[], object], report: Callable[[bool], str]) -> None:
    """The run's figures on stdout: ``document()`` as JSON for ``--format json``, else the text
    of ``report(markdown)``."""
    if fmt == "json":
        emit_json(document())
    else:
        print(report(fmt == "markdown"))


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


# -- targets ----------------------------------------------------------------------------------
@dataclass
class Target:
    """A figure against its target: at least ``required`` (or at most, when not
    ``higher_is_better``); a NaN figure was not measured, and misses."""

    name: str
    measured: float
    required: float
    unit: str
    detail: str
    higher_is_better: bool = True

    @property
    def passed(self) -> bool:
        if self.measured != self.measured:
            return False
        if self.higher_is_better:
            return self.measured >= self.required
        return self.measured <= self.required

    def verdict(self) -> str:
        m, r, u, x = fmt_number(self.measured), fmt_number(self.required), self.unit, self.measured
        if x != x:
            return f"MISS  {self.name}: not measured; {self.detail}"
        if self.passed:
            sign, how = (
                (">=", f"{x / self.required:.2f}x")
                if self.higher_is_better
                else ("<=", f"{x / self.required:.0%} of it")
            )
            return f"PASS  {self.name}: {m} {u} {sign} {r} ({how}); {self.detail}"
        if self.higher_is_better:
            short = self.required - x
            return (
                f"MISS  {self.name}: {m} {u} < {r}: short by {fmt_number(short)} {u} "
                f"({short / self.required:.0%} below; needs {self.required / x:.2f}x); "
                f"{self.detail}"
            )
        return (
            f"MISS  {self.name}: {m} {u} > {r}: over by {fmt_number(x - self.required)} {u} "
            f"({x / self.required:.1f}x the limit); {self.detail}"
        )

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "verdict": self.verdict()}


# -- command lines ------------------------------------------------------------------------------
def arguments(
    doc: str | None,
    *,
    quick: str | None = None,
    markdown: bool = True,
    output: bool = True,
    keep: bool = True,
    profile: str | None = None,
) -> argparse.ArgumentParser:
    """A benchmark's parser with the options they share: ``--quick`` (when ``quick`` is its
    help), ``--format`` (text, markdown unless not ``markdown``, json; unless not ``output``),
    ``--dir``, ``--keep`` (unless not ``keep``) and ``--profile`` auto|always|never (when
    ``profile`` is what it profiles)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)
    if output:
        formats = ("text", "markdown", "json") if markdown else ("text", "json")
        parser.add_argument(
            "--format", choices=formats, default="text", help="the figures' form on stdout"
        )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="parent of the temporary directory (default ./data), on the filesystem to measure",
    )
    if keep:
        parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    if profile:
        parser.add_argument(
            "--profile",
            choices=("auto", "always", "never"),
            default="auto",
            help=f"py-spy {profile}: when a target is missed (auto), always, never",
        )
    return parser


# -- the machine ------------------------------------------------------------------------------
def _first_line_with(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def filesystem_of(path: Path) -> dict[str, str]:
    """The mount (device, mount point, type) that holds ``path``."""
    target = str(path.resolve())
    best = {"device": "?", "mount": "/", "type": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype, *_ = line.split()
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best["mount"]):
                    best = {"device": device, "mount": mount, "type": fstype}
    except OSError:
        pass
    return best


def machine_info(directory: Path) -> dict[str, Any]:
    mem_kb = _first_line_with("/proc/meminfo", "MemTotal")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": _first_line_with("/proc/cpuinfo", "model name") or platform.processor(),
        "memory_gib": round(int(mem_kb.split()[0]) / (1 << 20), 1) if mem_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": filesystem_of(directory),
        "directory": str(directory),
    }


def run_facts(directory: Path) -> dict[str, Any]:
    """What every run's JSON starts with: the command that ran and the machine."""
    return {"command": shlex.join(["python", *sys.argv]), "machine": machine_info(directory)}


def machine_line(info: dict[str, Any]) -> str:
    """``machine_info`` in a line: cores, CPU, memory, kernel, Python, the directory's device."""
    fs = info["filesystem"]
    return (
        f"machine: {info['cpus']} cores ({info['cpu_model']}), {info['memory_gib']} GiB, "
        f"Linux {info['kernel']}, Python {info['python']}; {info['directory']} on "
        f"{fs['device']} ({fs['type']}, mounted at {fs['mount']})"
    )


def bench_directory(parent: Path | None, prefix: str) -> Path:
    """A fresh temporary directory under ``parent`` (default ``./data``), created here."""
    base = parent if parent is not None else Path.cwd() / "data"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@contextlib.contextmanager
def scratch_directory(parent: Path | None, prefix: str, *, keep: bool = False) -> Iterator[Path]:
    """``bench_directory``, removed at the end unless ``keep``: a run's logs are hundreds of MB
    to GBs, and runs that leave them fill the disk (a nearly full filesystem made this
    machine's fdatasyncs ~4x slower)."""
    directory = bench_directory(parent, prefix)
    try:
        yield directory
    finally:
        if keep:
            progress(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


# -- child processes: JSON lines on their stdout -------------------------------------------------
def say(document: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: what a benchmark's child process tells it."""
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


class ChildLines:
    """The lines a child writes on its stdout, each read with a deadline, from the pipe's file
    descriptor (a buffered reader would hide lines it had already read from ``select``)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self._proc = proc
        self._fd = proc.stdout.fileno()
        self._buffer = bytearray()

    def line(self, timeout: float) -> str | None:
        """The next line; None when none came within ``timeout`` (0: only look);
        ``RuntimeError`` once the child has ended."""
        deadline = time.monotonic() + timeout
        while (end := self._buffer.find(b"\n")) < 0:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(left, 0.0))
            if not ready:
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"pid {self._proc.pid} exited (code {self._proc.poll()})")
            self._buffer += chunk
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return line.decode(errors="replace")

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The next line's object (None: none within ``timeout``); ``RuntimeError`` for one
        that says ``error``."""
        line = self.line(timeout)
        if line is None:
            return None
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"pid {self._proc.pid} failed: {message['error']}")
        return message

    def expect(self, key: str, timeout: float) -> dict[str, Any]:
        """The next line's object, which must come within ``timeout`` and say ``key`` ("" for
        any)."""
        message = self.next(timeout)
        if message is None:
            raise TimeoutError(f"pid {self._proc.pid}: nothing within {timeout:.0f} s")
        if key and key not in message:
            raise RuntimeError(f"pid {self._proc.pid} said {message}, not {key!r}")
        return message


# -- child processes that serve on loopback --------------------------------------------------------
@contextlib.contextmanager
def serving_child(
    command: Sequence[str], port_file: Path, log: Path | None = None, start_s: float = 60
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``command --port-file PORT_FILE`` (output to ``log`` when given) until the child has
    written what it serves on (a port, a URL) into the file; yield the child and that text;
    SIGTERM it at the end (SIGKILL after 30 s)."""
    port_file.unlink(missing_ok=True)
    out = log.open("wb") if log is not None else None
    proc = subprocess.Popen(
        [*command, "--port-file", str(port_file)], stdout=out, stderr=out and subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + start_s
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                said = log.read_text() if log is not None else "(its output is above)"
                raise RuntimeError(f"{' '.join(command[1:])} did not start: {said}")
            time.sleep(0.05)
        yield proc, port_file.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if out is not None:
            out.close()


def serve_app(app: Any, port_file: Path) -> None:
    """Serve the aiohttp ``app`` on a free loopback port, on uvloop, written to ``port_file``,
    until the process is ended."""
    import uvloop
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_file.write_text(str(site._server.sockets[0].getsockname()[1]))  # type: ignore[union-attr]
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


# -- meters -----------------------------------------------------------------------------------
def _cpu_jiffies() -> list[int]:
    """The jiffies of every CPU of the machine by kind (user, nice, system, idle, iowait, irq,
    softirq, steal, ...), from /proc/stat's first line."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the machine."""
    fields = _cpu_jiffies()
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


def _steal_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of every CPU of the machine."""
    fields = _cpu_jiffies()
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


@dataclass
class Steal:
    """The share of this VM's CPU time the hypervisor took for something else ("steal") from
    the moment this is made: when it is high, every figure of the run is low for reasons
    outside the code measured."""

    _j0: tuple[int, int] = field(default_factory=_steal_jiffies, repr=False)

    def share(self) -> float:
        steal, total = _steal_jiffies()
        dt = total - self._j0[1]
        return (steal - self._j0[0]) / dt if dt > 0 else float("nan")

    def line(self) -> str:
        return (
            f"CPU time the hypervisor took from this VM during the run (steal): {self.share():.1%}"
        )


@dataclass
class Meter:
    """Wall time, this process's CPU time and the whole machine's CPU use over a span."""

    wall_s: float = 0.0
    process_cpu_s: float = 0.0
    machine_busy: float = 0.0  # share of all the machine's CPUs that were busy (0..1)
    _t0: float = field(default=0.0, repr=False)
    _c0: float = field(default=0.0, repr=False)
    _j0: tuple[int, int] = field(default=(0, 0), repr=False)

    def start(self) -> None:
        self._j0 = _machine_jiffies()
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.process_cpu_s = time.process_time() - self._c0
        busy, total = _machine_jiffies()
        dt = total - self._j0[1]
        self.machine_busy = (busy - self._j0[0]) / dt if dt > 0 else float("nan")

    @property
    def process_cores(self) -> float:
        """Average number of cores this process kept busy."""
        return self.process_cpu_s / self.wall_s if self.wall_s > 0 else float("nan")


def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted samples (nearest rank)."""
    if not sorted_samples:
        return float("nan")
    rank = max(0, min(len(sorted_samples) - 1, round(q / 100 * len(sorted_samples)) - 1))
    return sorted_samples[rank]


def _short_path(filename: str) -> str:
    for marker in ("/site-packages/", "/src/", "/lib/python3"):
        i = filename.rfind(marker)
        if i >= 0:
            rest = filename[i + len(marker) :]
            return rest.split("/", 1)[1] if marker == "/lib/python3" and "/" in rest else rest
    return Path(filename).name


# -- profiling: py-spy (a sampling profiler, all threads) ---------------------------------------
PY_SPY_MISSING = "py-spy not found: `pip install py-spy` (any environment) and set PY_SPY to it"


def find_py_spy() -> str | None:
    """``$PY_SPY``, ``py-spy`` next to this Python, or on ``PATH``; None when absent."""
    candidates = [
        os.environ.get("PY_SPY"),
        str(Path(sys.executable).parent / "py-spy"),
        shutil.which("py-spy"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class ThreadSamples:
    thread: str
    samples: int
    leaves: list[tuple[str, int]]  # (function, samples where it was the innermost frame)
    inclusive: list[tuple[str, int]]  # (function, samples where it was anywhere on the stack)


def start_py_spy(
    executable: str, pid: int, out: Path, *, rate: int, seconds: float | None = None, mode: str = ""
) -> subprocess.Popen[bytes]:
    """py-spy sampling every thread of ``pid`` into ``out`` (raw, collapsed stacks) for
    ``seconds`` (None: until ``pid`` exits). ``mode``: "" (threads that were running: where CPU
    goes), "gil" (only the GIL holder) or "idle" (every thread, waits included)."""
    command = [executable, "record", "--pid", str(pid), "--rate", str(rate), "--threads"]
    command += ["--duration", str(max(1, round(seconds)))] if seconds is not None else []
    command += [f"--{mode}"] if mode else []
    command += ["--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def py_spy_samples(spy: subprocess.Popen[bytes], out: Path, timeout: float) -> str:
    """What ``spy`` recorded once it has finished ("" when it could not attach); SIGINT (it
    writes what it has) when it has not finished within ``timeout`` seconds."""
    try:
        _, err = spy.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate()
    if out.exists():
        return out.read_text()
    progress(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}")
    return ""


@contextlib.contextmanager
def py_spy_record(
    executable: str, seconds: int, *, rate: int = 200
) -> Iterator[list[ThreadSamples]]:
    """Sample this process's GIL holder with py-spy for ``seconds``. Keep the workload running
    at least a second longer so that every sample is of it. The list yielded is filled once the
    block ends; it stays empty when py-spy cannot attach."""
    result: list[ThreadSamples] = []
    with tempfile.TemporaryDirectory(prefix="bench-pyspy-") as tmp:
        out = Path(tmp) / "samples.txt"
        spy = start_py_spy(executable, os.getpid(), out, rate=rate, seconds=seconds, mode="gil")
        try:
            yield result
        finally:
            result.extend(parse_py_spy_raw(py_spy_samples(spy, out, seconds + 30)))


def py_spy_record_pid(executable: str, pid: int, seconds: float, *, rate: int = 100) -> str:
    """Sample another process's running threads with py-spy for ``seconds``; py-spy's raw text
    ("" when it could not attach). Blocks for the duration."""
    with tempfile.TemporaryDirectory(prefix="bench-pyspy-") as tmp:
        out = Path(tmp) / "samples.txt"
        spy = start_py_spy(executable, pid, out, rate=rate, seconds=seconds)
        return py_spy_samples(spy, out, seconds + 30)


def parse_py_spy_raw(
    text: str, n: int = 10, names: Mapping[int, str] | None = None
) -> list[ThreadSamples]:
    """Summarise py-spy's raw (collapsed-stack) output per thread (busiest first); ``names``
    renames threads by their id."""
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        head, *frames = stack.split(";")
        found = re.match(r"thread \((\d+)\)(?::\s*(.*))?", head)
        tid = int(found.group(1)) if found else 0
        named = found.group(2) if found else None
        thread = (names or {}).get(tid) or named or head.split(": ", 1)[-1]
        thread = re.sub(r"-\d+( \(.*\))?$", "", thread)  # Thread-7 (run) -> Thread
        frames = [_strip_line(f) for f in frames]
        totals[thread] += count
        if frames:
            leaves[thread][frames[-1]] += count
        for f in set(frames):
            inclusive[thread][f] += count
    return [
        ThreadSamples(
            thread, total, leaves[thread].most_common(n), inclusive[thread].most_common(n)
        )
        for thread, total in totals.most_common()
    ]


def _strip_line(frame: str) -> str:
    """'name (/x/src/y.py:12)' -> 'name (y.py)', so one function's lines count together."""
    name, _, where = frame.partition(" (")
    return f"{name} ({_short_path(where.rsplit(':', 1)[0])})" if where else name


# -- other processes: CPU, memory, file descriptors, py-spy by pid ------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ProcessSample:
    """A process's CPU time so far (all its threads), its resident set, and the machine's
    jiffies at the same moment."""

    cpu_s: float
    rss_mb: float  # VmRSS in decimal MB (10^6 bytes)
    threads: dict[int, tuple[str, float]]  # tid -> (name, CPU seconds so far)
    machine: tuple[int, int]  # (busy, total) jiffies of the whole machine
    at: float  # time.perf_counter() when taken
    pss_mb: float = float("nan")  # proportional set size (shared pages split between sharers)
    pids: tuple[int, ...] = ()  # the processes summed (``sample_tree``)


def sample_process(pid: int) -> ProcessSample:
    """CPU seconds (user + system, every thread), RSS and per-thread CPU of ``pid``, from
    /proc; zeros for a process that is gone."""
    cpu, rss_kb = 0.0, 0
    threads: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss_kb = int(line.split()[1])
                    break
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    text = f.read()
                name = text[text.index("(") + 1 : text.rindex(")")]
                tf = text.rsplit(")", 1)[1].split()
                threads[int(task)] = (name, (int(tf[11]) + int(tf[12])) / CLOCK_TICKS)
    return ProcessSample(cpu, rss_kb * 1024 / MB, threads, _machine_jiffies(), time.perf_counter())


def sample_tree(pid: int) -> ProcessSample:
    """``sample_process`` summed over ``pid`` and its descendants (a server that forks
    workers): CPU, RSS (shared pages counted in each process) and PSS (counted once), and
    every thread of them all."""
    pids = tuple(tree_pids(pid))
    samples = [sample_process(p) for p in pids]
    threads: dict[int, tuple[str, float]] = {}
    for s in samples:
        threads.update(s.threads)
    return ProcessSample(
        sum(s.cpu_s for s in samples),
        sum(s.rss_mb for s in samples),
        threads,
        samples[0].machine,
        samples[0].at,
        sum(_pss(p) for p in pids) / MB,
        pids,
    )


def cores_between(a: ProcessSample, b: ProcessSample) -> float:
    """Average number of cores the process kept busy between two samples."""
    wall = b.at - a.at
    return (b.cpu_s - a.cpu_s) / wall if wall > 0 else float("nan")


def machine_busy_between(a: ProcessSample, b: ProcessSample) -> float:
    """Share (0..1) of all the machine's CPUs that were busy between two samples."""
    dt = b.machine[1] - a.machine[1]
    return (b.machine[0] - a.machine[0]) / dt if dt > 0 else float("nan")


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's open-file limit towards ``want`` (children inherit it); returns
    the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limits in ((want, max(want, hard)), (min(want, hard), hard)):
        if limits[0] <= soft:
            return soft
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            return limits[0]
        except (ValueError, OSError):
            continue
    return soft


# -- an Apache Kafka broker for the Kafka cases ------------------------------------------------
def kafka_broker(brokers: int = 1) -> contextlib.AbstractContextManager[KafkaCluster]:
    """Apache Kafka brokers (KRaft, on loopback, JVM ``KAFKA_JVM``), started as the tests start
    them (``headwater.testing.kafka``: with 3, replication 3 and ``min.insync.replicas`` 2)
    and stopped, their data removed, when the block ends. They are children of this process:
    leave them out of a ``TreeRss`` (``exclude``)."""
    from headwater.jvm.maven import KAFKA_VERSION
    from headwater.testing.kafka import start_kafka

    what = "one broker" if brokers == 1 else f"{brokers} brokers"
    progress(f"starting Apache Kafka {KAFKA_VERSION}: {what} (KRaft) on loopback")
    return start_kafka(brokers, jvm_options=KAFKA_JVM)


def broker_figures(kafka: KafkaCluster) -> dict[str, Any]:
    """What a run reports of the broker: its version, JVM and peak RSS (VmHWM) so far."""
    from headwater.jvm.maven import KAFKA_VERSION

    return {
        "kafka_version": KAFKA_VERSION,
        "brokers": len(kafka.nodes),
        "jvm_options": list(KAFKA_JVM),
        "peak_rss_bytes": sum(peak_rss(n.process.pid) or 0 for n in kafka.alive()),
    }


# -- memory of a process tree -------------------------------------------------------------------
class TreeRss:
    """Samples the summed RSS of a process and all its descendants (default: this process),
    keeping the peak: Spark's memory is mostly in the JVM and the Python workers, children of
    the driver, so one process's RSS would miss most of it. ``exclude``: processes left out
    with their descendants (a service the benchmark started, such as a Kafka broker)."""

    def __init__(
        self, interval: float = 0.2, root: int | None = None, exclude: Collection[int] = ()
    ) -> None:
        self.peak = 0
        self.peak_pss = 0  # proportional set size: shared pages (forked workers) counted once
        self.at_peak: list[tuple[str, int]] = []  # (process, RSS) at the peak, largest first
        self._root = root if root is not None else os.getpid()
        self._exclude = frozenset(exclude)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._interval = interval

    def __enter__(self) -> TreeRss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        pids = tree_pids(self._root, self._exclude)
        sizes = [(pid, rss(pid)) for pid in pids]
        total = sum(size for _, size in sizes)
        if total > self.peak:
            self.peak = total
            named = [(process_name(pid), size) for pid, size in sizes if size]
            self.at_peak = sorted(named, key=lambda n: -n[1])
        self.peak_pss = max(self.peak_pss, sum(_pss(pid) for pid in pids))


def process_name(pid: int) -> str:
    """What a process is, in a few words: ``java`` for a JVM, the module of ``python -m``
    (with its first argument: PySpark's daemons name their worker module), else the command."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if os.path.basename(argv[0]) == "java":
        return "java"
    if "-m" in argv[:-1]:
        return " ".join(argv[argv.index("-m") + 1 :][:2])
    return " ".join(os.path.basename(a) for a in argv[:2])


def peak_rss(pid: int) -> int | None:
    """The highest RSS ``pid`` has had so far (``VmHWM``), in bytes; None when it is gone."""
    found = _first_line_with(f"/proc/{pid}/status", "VmHWM")
    return int(found.split()[0]) * 1024 if found else None


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0
