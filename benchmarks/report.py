"""What every benchmark does with its results: time a call, describe the machine, print the
table, append it to RESULTS.md."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def median_seconds(call, runs: int) -> float:
    """The median wall time of ``runs`` calls: one slow call on a shared machine moves it least."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def describe(*versions: str) -> str:
    """CPU model, cores, memory, Python, the given library versions, and the load average:
    these machines are shared, so the load says how much to trust a timing."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB", f"Python {platform.python_version()}", *versions]
    return "; ".join(parts) + f"; load average {os.getloadavg()[0]:.1f} at start"


def publish(lines: list[str], append: bool = True) -> str:
    """Print a results section and (unless ``append`` is False) append it to benchmarks/RESULTS.md."""
    text = "\n".join(lines) + "\n"
    print(text)
    if append:
        with RESULTS.open("a", encoding="utf-8") as f:
            f.write(text)
    return text
