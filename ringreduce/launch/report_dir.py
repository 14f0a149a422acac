"""A job's report directory: where its ranks leave what ringrun reads after
the job (flight recorder dumps, ringreduce/core/flight_recorder.py), and
whatever else a part of ringreduce reports per job.

    report = open_report_dir()       # RINGREDUCE_REPORT_DIR, or a fresh ringrun-* directory
    env["RINGREDUCE_REPORT_DIR"] = report.path
    ...
    kept = close_report_dir(report)  # removed if ringrun made it and nothing was left in it

Ranks find it in RINGREDUCE_REPORT_DIR. One set by the user is used as it
is and never removed.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

ENV = "RINGREDUCE_REPORT_DIR"
MARKER_SUFFIX = ".pid"  # a rank's "SIGUSR1 dumps" marker (flight_recorder.marker_name): ringrun's to remove


@dataclass(frozen=True)
class ReportDir:
    path: str
    owned: bool  # made by ringrun for this job (removed at the end when empty)


def open_report_dir(environ=None) -> ReportDir:
    """RINGREDUCE_REPORT_DIR from environ (made if missing), else a fresh
    private directory tempfile.mkdtemp(prefix="ringrun-")."""
    environ = os.environ if environ is None else environ
    given = environ.get(ENV, "").strip()
    if given:
        os.makedirs(given, exist_ok=True)
        return ReportDir(os.path.abspath(given), False)
    return ReportDir(tempfile.mkdtemp(prefix="ringrun-"), True)


def close_report_dir(report: ReportDir) -> bool:
    """Removes the ranks' markers, then the directory itself when ringrun made
    it and nothing else is in it. Returns whether it is kept."""
    try:
        names = os.listdir(report.path)
    except OSError:
        return False
    for name in names:
        if name.startswith("flight_rank") and name.endswith(MARKER_SUFFIX):
            try:
                os.unlink(os.path.join(report.path, name))
            except OSError:
                pass
    if not report.owned:
        return True
    try:
        os.rmdir(report.path)  # fails while anything is left in it
        return False
    except OSError:
        return True
