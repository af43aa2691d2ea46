"""What every benchmark does with its results: time a call, describe the machine, print the
table, and write it to RESULTS.md in place of its last run's section."""

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
    """Print a results section and (unless ``append`` is False) write it to benchmarks/RESULTS.md:
    in place of the sections with the same heading (its first line) when there are some, a rerun
    replacing its last results, else at the end."""
    text = "\n".join(lines) + "\n"
    print(text)
    if append:
        RESULTS.write_text(replaced(RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else "", text), encoding="utf-8")
    return text


def replaced(document: str, section: str) -> str:
    """``document`` with ``section`` in place of the first section of the same heading, and any
    later ones of that heading removed; appended when there is none."""
    section = section.lstrip("\n")  # a section written as "\n## ...": its heading is its first non-blank line
    heading = section.split("\n", 1)[0]
    parts = document.split("\n## ")
    head, sections = parts[0], ["## " + p for p in parts[1:]]
    if document.startswith("## "):
        head, sections = "", [document] if len(parts) == 1 else [parts[0]] + ["## " + p for p in parts[1:]]
    same = [i for i, s in enumerate(sections) if s.split("\n", 1)[0] == heading]
    if not same:
        return document.rstrip("\n") + "\n\n" + section if document.strip() else section
    kept = [s for i, s in enumerate(sections) if i not in same[1:]]
    kept[same[0]] = section.rstrip("\n") + "\n"
    return "\n".join(x.rstrip("\n") + "\n" for x in ([head] if head else []) + kept)
