"""Collapse tqdm progress bars in kept logs: each bar keeps its last state before any other line, nothing else changes.

    python scripts/squeeze_logs.py                 # every tracked text file under results/ that holds a bar
    python scripts/squeeze_logs.py run.log --dry   # sizes only

A progress bar redraws itself with carriage returns, so a log of a 10-minute training run holds thousands of
states of one line (280 KB of a 290 KB log). The lines that say something (commands, timings, tables, messages
printed between a bar's states) stay, in order; a run of states of the same bar becomes its last one.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

# A tqdm state: "desc:  45%|####      | 9/20 [..." or, without a total, "desc: 12it [00:01, ...".
BAR = re.compile(r"\d+%\|[^|]*\|\s*[\d.]+[kMG]?/[\d.?]+[kMG]?|[\d.]+[kMG]?(?:it|step|batch|B|s)? \[\d+:\d+")


def bar_key(segment: str) -> str | None:
    """The bar a segment is a state of (its description), or None for a segment that is no bar."""
    match = BAR.search(segment)
    return None if match is None else segment[: match.start()].rstrip()


def squeeze(text: str) -> str:
    """``text`` with each run of carriage-return states of one bar reduced to its last; blank redraws dropped."""
    out = []
    for line in text.split("\n"):
        if "\r" not in line:
            out.append(line)
            continue
        kept: list[str] = []
        last: object = object()
        for segment in line.split("\r"):
            if not segment.strip():  # a bar cleared before a message
                continue
            key = bar_key(segment)
            if key is not None and key == last:
                kept[-1] = segment  # the same bar, a later state
            else:
                kept.append(segment)
            last = key
        out.extend(segment.rstrip() for segment in kept)
    return "\n".join(out)


def tracked_results() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "results"], capture_output=True, text=True, check=True)
    return [Path(name) for name in listed.stdout.split("\0") if name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="logs to rewrite (default: tracked files in results/)")
    parser.add_argument("--dry", action="store_true", help="print the sizes, write nothing")
    args = parser.parse_args()
    for path in args.paths or tracked_results():
        data = path.read_bytes()
        if b"\r" not in data or b"\0" in data:  # no bar, or not text (a PNG)
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        new = squeeze(text).encode("utf-8")
        print(f"{len(data):>9,} -> {len(new):>9,} bytes  {path}")
        if not args.dry:
            path.write_bytes(new)


if __name__ == "__main__":
    main()
