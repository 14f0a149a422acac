"""What this rank's /metrics holds: a Recorder counts what happens between
scrapes (collectives, their latency and errors, lost peers), fed by core's
listeners; the Collector reads everything else when Prometheus scrapes
(bytes sent, the engine, the elastic generation, straggler scores), so no
thread keeps gauges up to date and a scrape sees this moment's values.

Every sample carries the labels rank, local_rank, host and job, read at
scrape time (an elastic job's rank changes with its generation): rank and
local_rank are empty while this process is in no ring; job is
RINGREDUCE_JOB (ringrun sets it, one id per job), else empty.
"""
from __future__ import annotations

import bisect
import logging
import os
import socket
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .. import core, elastic, engine
from ..core import traffic
from ..errors import PeerLostError

# Collective latency buckets, seconds: a small allreduce on one host takes
# ~10 us, a large one across hosts seconds, a collective waiting on a slow
# rank up to RINGREDUCE_TIMEOUT (60 s by default).
BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
           1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))

LABELS = ("rank", "local_rank", "host", "job")

log = logging.getLogger("ringreduce")


class Recorder:
    """Counts collectives as core reports them (listeners.add_listener(recorder.collective))."""

    def __init__(self):
        self._lock = threading.Lock()
        self.latency: dict[str, list] = {}  # kind -> [bucket counts (not cumulative), sum of seconds]
        self.errors: dict[tuple[str, str], int] = {}  # (kind, exception class name) -> count
        self.lost: dict[str, int] = {}  # the lost peer's rank ("" when unknown) -> PeerLostErrors
        self.straggler_source = None  # fn() -> {rank: score}; None: the engine straggler report

    def collective(self, kind: str, seconds: float | None, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                if seconds is not None:
                    counts = self.latency.setdefault(kind, [[0] * len(BUCKETS), 0.0])
                    counts[0][bisect.bisect_left(BUCKETS, seconds)] += 1
                    counts[1] += seconds
                return
            key = (kind, type(error).__name__)
            self.errors[key] = self.errors.get(key, 0) + 1
            if isinstance(error, PeerLostError):
                peer = "" if error.rank is None else str(error.rank)
                self.lost[peer] = self.lost.get(peer, 0) + 1

    def snapshot(self):
        with self._lock:
            return ({k: (list(v[0]), v[1]) for k, v in self.latency.items()}, dict(self.errors), dict(self.lost))

    def stragglers(self):
        """{rank: score} from the source (default: the engine's straggler
        report, ringreduce.engine.straggler_report), or None where there is
        none (or it failed: logged, and the scrape goes on without the scores)."""
        source = self.straggler_source or _engine_scores
        try:
            return {int(peer): float(score) for peer, score in (source() or {}).items()}
        except Exception:
            log.exception("ringreduce: the straggler score source (%r) failed; no scores in this scrape", source)
            return None


def _engine_scores() -> dict:
    """{rank: score} of the ranks the engine's straggler window has scored."""
    from .. import engine
    report = engine.straggler_report()
    return {x["rank"]: x["score"] for x in report.get("ranks", ()) if x.get("score") is not None}


class Collector:
    """prometheus_client's custom collector: collect() builds every family now."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def collect(self):
        initialized = core.is_initialized()
        try:
            rank, local_rank = (str(core.rank()), str(core.local_rank())) if initialized else ("", "")
        except Exception:  # shut down between the two reads
            rank, local_rank = "", ""
        base = [rank, local_rank, socket.gethostname(), os.environ.get("RINGREDUCE_JOB", "")]

        def family(kind, name, doc, extra=(), **kw):
            return kind(name, doc, labels=list(LABELS) + list(extra), **kw)

        sent = (traffic.stats_now() if initialized
                else {k: 0 for k in traffic.KINDS + traffic.VIAS + traffic.RECEIVED})
        f = family(CounterMetricFamily, "ringreduce_transport_sent_bytes",
                   "Bytes this rank sent since init or reset_stats, by transport (rr.stats())", ["transport"])
        for via in traffic.VIAS:
            f.add_metric(base + [via], sent[via])
        yield f
        f = family(CounterMetricFamily, "ringreduce_transport_received_bytes",
                   "Bytes of the other ranks' data this rank took in since init or reset_stats, by transport "
                   "(rr.stats()); a host arena slot is received by every other rank of the host", ["transport"])
        for via, key in zip(traffic.VIAS, traffic.RECEIVED):
            f.add_metric(base + [via], sent[key])
        yield f
        f = family(CounterMetricFamily, "ringreduce_purpose_sent_bytes",
                   "Bytes this rank sent since init or reset_stats, by purpose: ring data steps, blobs "
                   "(headers, negotiation, small allreduces), alltoall (rr.stats())", ["purpose"])
        for kind in traffic.KINDS:
            f.add_metric(base + [kind], sent[kind])
        yield f

        latency, errors, lost = self.recorder.snapshot()
        f = family(HistogramMetricFamily, "ringreduce_collective_duration_seconds",
                   "Wall time of each collective that succeeded on this rank, by kind", ["kind"])
        for kind, (counts, total) in sorted(latency.items()):
            cumulative, buckets = 0, []
            for bound, n in zip(BUCKETS, counts):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            f.add_metric(base + [kind], buckets, total)
        yield f
        f = family(CounterMetricFamily, "ringreduce_collective_errors",
                   "Collectives that raised on this rank, by kind and exception (kind engine: "
                   "the engine stopped on it while negotiating)", ["kind", "error"])
        for (kind, error), n in sorted(errors.items()):
            f.add_metric(base + [kind, error], n)
        yield f
        f = family(CounterMetricFamily, "ringreduce_peer_lost",
                   "PeerLostErrors this rank raised, by the rank lost", ["peer"])
        for peer, n in sorted(lost.items()):
            f.add_metric(base + [peer], n)
        yield f

        f = family(GaugeMetricFamily, "ringreduce_world_size", "Ranks in this process's ring (0: in none)")
        try:
            f.add_metric(base, core.size() if initialized else 0)
        except Exception:  # shut down meanwhile
            f.add_metric(base, 0)
        yield f

        yield from self._engine(family, base)

        f = family(GaugeMetricFamily, "ringreduce_elastic_generation",
                   "The elastic generation of the running ring (0: not elastic, or in no ring)")
        f.add_metric(base, core.communicator().generation if initialized else 0)
        yield f
        f = family(CounterMetricFamily, "ringreduce_elastic_resets",
                   "Times this process re-formed the ring after a lost peer or a change of hosts (elastic.reset)")
        f.add_metric(base, elastic.resets())
        yield f

        f = family(GaugeMetricFamily, "ringreduce_straggler_score",
                   "How late each rank is, as the engine's straggler report scores it", ["peer"])
        for peer, score in sorted((self.recorder.stragglers() or {}).items()):
            f.add_metric(base + [str(peer)], score)
        yield f

    @staticmethod
    def _engine(family, base):
        """The background engine's families, empty while no engine runs."""
        running = engine.running()
        depth = family(GaugeMetricFamily, "ringreduce_engine_queue_depth",
                       "Requests handed to the engine on this rank and not done yet")
        cycles = family(CounterMetricFamily, "ringreduce_engine_cycles",
                        "The engine's working cycles (those that ran or failed some request)")
        seconds = family(CounterMetricFamily, "ringreduce_engine_cycle_seconds",
                         "Seconds the engine's working cycles took, negotiation to the last result")
        last = family(GaugeMetricFamily, "ringreduce_engine_last_cycle_seconds",
                      "Seconds the engine's last working cycle took")
        passes = family(CounterMetricFamily, "ringreduce_engine_negotiation_passes",
                        "The engine's negotiation passes, idle ones included")
        negotiating = family(CounterMetricFamily, "ringreduce_engine_negotiation_seconds",
                             "Seconds the engine spent in negotiation passes")
        if running is not None:
            c, n = running.cycle_stats, running.stats
            depth.add_metric(base, running.queue_depth())
            cycles.add_metric(base, c.cycles)
            seconds.add_metric(base, c.seconds)
            last.add_metric(base, c.last_seconds)
            passes.add_metric(base, n.cycles)
            negotiating.add_metric(base, n.seconds)
        yield from (depth, cycles, seconds, last, passes, negotiating)
