"""Reads a finished job's flight recorder dumps and prints ringrun's verdict.

    python -m ringreduce.launch.postmortem DIR      # or: ringrun --postmortem DIR

DIR holds flight_rank{R}.json, one per rank (ringreduce/core/flight_recorder.py):
ringrun's report directory of a failed job (kept, and named on stderr), or
RINGREDUCE_FLIGHT_DIR. The verdict is ringreduce/launch/verdict.py's.
"""
from __future__ import annotations

import json
import os
import re
import sys

from .verdict import verdict

_DUMP = re.compile(r"flight_rank(\d+)\.json")
FORMAT = 1  # ringreduce/core/flight_recorder.py FORMAT


def load_dumps(directory: str, since: float | None = None) -> dict:
    """{rank: parsed dump} of every readable dump in directory (one that does
    not parse, or of another format, is left out and said on stderr); with
    `since` (wall-clock seconds), only dumps written since (a report
    directory the user keeps across jobs holds older ones)."""
    dumps = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return dumps
    for name in sorted(names):
        m = _DUMP.fullmatch(name)
        if not m:
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"ringrun: {name} left out: {exc}", file=sys.stderr)
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            print(f"ringrun: {name} left out: not a flight recorder dump of format {FORMAT}", file=sys.stderr)
            continue
        if since is not None and not data.get("wall", 0) >= since:
            continue
        dumps[int(m.group(1))] = data
    return dumps


def job_verdict(directory: str, size: int | None = None, since: float | None = None) -> str | None:
    """The verdict on the dumps in directory (written since `since`); None when there are none."""
    dumps = load_dumps(directory, since)
    return verdict(dumps, size) if dumps else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m ringreduce.launch.postmortem DIR  (a directory of flight_rank*.json)",
              file=sys.stderr)
        return 2
    if not os.path.isdir(argv[0]):
        print(f"ringrun: {argv[0]} is not a directory", file=sys.stderr)
        return 2
    text = job_verdict(argv[0])
    if text is None:
        print(f"ringrun: no flight recorder dumps (flight_rank*.json) in {argv[0]}", file=sys.stderr)
        return 1
    print(f"ringrun: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
