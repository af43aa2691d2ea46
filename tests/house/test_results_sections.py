"""benchmarks/RESULTS.md holds one section per benchmark run kind: a rerun replaces its section
(``report.publish``, through ``report.replaced``) rather than appending another. That holds only
while headings are stable (no date or time in them) and while every benchmark writes through
``report.publish``."""

from __future__ import annotations

import re
from collections import Counter

from support import REPO

BENCHMARKS = REPO / "benchmarks"
# Writing RESULTS.md other than through report.py: opening or writing the RESULTS path, or
# opening the file by name.
DIRECT_WRITES = re.compile(r"RESULTS\.open\(|RESULTS\.write_text\(|open\([^)\n]*RESULTS\.md")


def test_no_two_sections_of_results_share_a_heading():
    """``report.replaced`` finds the section to replace by its heading: two of the same heading are
    a rerun that was appended instead, and the older one's figures read as current."""
    headings = [
        line for line in (BENCHMARKS / "RESULTS.md").read_text(encoding="utf-8").splitlines() if line.startswith("## ")
    ]
    repeated = sorted(heading for heading, n in Counter(headings).items() if n > 1)
    assert not repeated, f"headings of more than one section: {repeated}"


def test_only_report_writes_results():
    """A benchmark that writes RESULTS.md itself (appending to it, say) bypasses the replacing of
    its last run's section, which lives in one place: ``report.publish``."""
    writers = sorted(
        path.name
        for path in BENCHMARKS.glob("*.py")
        if path.name != "report.py" and DIRECT_WRITES.search(path.read_text(encoding="utf-8"))
    )
    assert not writers, f"benchmarks that write RESULTS.md themselves, not through report.publish: {writers}"
