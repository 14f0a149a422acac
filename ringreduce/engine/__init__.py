"""The background engine: collectives handed over by name run on a thread of
their own, negotiated each cycle so every rank runs the same ones in the same
order, allreduces fused (scheduler.py; negotiation.py with its
response_cache.py; timeline.py records what ran).

The public calls the framework layers (ringreduce.tensorflow, compression,
elastic) use: engine(), Engine's enqueue / wait / withdraw / join / leave /
start_timeline / stats / straggler_report, register_kind, running, reset, join,
straggler_report (stragglers.py: which rank the others wait for).
"""
from .scheduler import (GLOBAL_PROCESS_SET, REFUSED, Engine, Handle, Kind, engine, join, register_kind, reset,
                        running, straggler_report)

__all__ = ["Engine", "Handle", "Kind", "engine", "join", "register_kind", "reset", "running", "REFUSED",
           "GLOBAL_PROCESS_SET", "straggler_report"]
