"""RayExecutor: a ringreduce job on Ray actors (docs/ringrun.md, "Ray").

    executor = RayExecutor(num_workers=4, cpus_per_worker=1)
    executor.start()                      # actors placed, ring formed
    results = executor.run(train, args=(lr,))   # train(lr) on every rank; results in rank order
    executor.shutdown()

The driver plays ringrun's part: it places one actor per rank in a placement
group, learns from each actor the node it landed on, makes rank 0's
rendezvous address that node's IP and a port free there, and gives every
actor RINGREDUCE_RANK/SIZE/ADDR/SECRET/LOCAL_RANK/LOCAL_SIZE before it calls
rr.init(). With `min_workers` below `num_workers` the job is elastic, as
under `ringrun --elastic`: the driver holds the rendezvous
(ringreduce/launch/rendezvous_server.py), a lost actor's peers re-form the
ring without it and go on from their last commit (the training function uses
ringreduce.elastic.run), and a replacement actor joins at the next commit.
"""
from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import PeerLostError, RingReduceError
from ..launch.rendezvous_server import RendezvousServer
from .worker import Worker

log = logging.getLogger("ringreduce")

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class WorkerFailedError(RingReduceError):
    """A run (or start) failed on some rank. `.rank` is the rank at fault
    (the first whose actor died, else the first whose function raised an
    error of its own rather than PeerLostError), `.errors` maps every rank
    that failed to its exception, `.results` every rank that finished to
    its result."""

    def __init__(self, message, rank=None, errors=None, results=None):
        super().__init__(message, rank)
        self.errors = dict(errors or {})
        self.results = dict(results or {})


class WorkerLostError(WorkerFailedError, PeerLostError):
    """A worker's Ray actor died (killed, its node lost, out of memory): the
    ring cannot go on without it (elastic jobs: fewer than min_workers are
    left, or restarts are used up)."""


class ActorDied(Exception):
    """Stands in `.errors` for a rank whose actor died (the text: Ray's reason)."""


@dataclass
class _Slot:
    """One worker: its actor, the bundle it holds, where it runs."""
    actor: object
    bundle: int
    worker_id: str
    node_id: str = ""
    ip: str = ""
    rank: int = -1
    ref: object = None             # the running execute call
    lost: str | None = None        # why its actor died
    newcomer: bool = False         # started to replace a lost one (elastic)
    extra: dict = field(default_factory=dict)


_REMOTE_WORKER = None


def _remote_worker():
    """Worker as a Ray actor class, made once per process."""
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        _REMOTE_WORKER = ray.remote(Worker)
    return _REMOTE_WORKER


def _check_number(name: str, value, low: float, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise TypeError(f"RayExecutor({name}={value!r}): expected {'an int' if integer else 'a number'}")
    if not math.isfinite(value) or value < low:
        raise ValueError(f"RayExecutor({name}={value!r}): must be >= {low}")


def _died_reason(exc: BaseException) -> str:
    """Ray's reason an actor died, on one line (its text runs to many)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = [ln for ln in lines if "because" in ln or "killed" in ln or "exit" in ln.lower()]
    return " ".join(why[:2] or lines[:1])[:400] or type(exc).__name__


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ActorDied):
        return f"its actor died ({exc})"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class RayExecutor:
    """A ringreduce job of `num_workers` Ray actors, one per rank.

    num_workers: ranks (actors), one placement-group bundle each.
    cpus_per_worker, gpus_per_worker: each bundle's (and actor's) resources;
        Ray sets CUDA_VISIBLE_DEVICES for an actor with GPUs.
    resources_per_worker: further custom resources per bundle, e.g. {"TPU": 1}.
    placement_strategy: PACK (default: as few nodes as fit, so ranks share
        memory links), SPREAD, STRICT_PACK or STRICT_SPREAD.
    env: more environment variables for every worker (RINGREDUCE_TIMEOUT, ...).
    min_workers: below num_workers, the job is elastic (module docstring):
        a lost worker's peers go on while at least min_workers remain.
    max_restarts: elastic only: lost workers replaced in all (each joins
        the ring at its next commit); 0 lets the ring shrink only.
    start_timeout: seconds for the placement group to be placed and the
        ring to form; grace: seconds the other ranks get to end once one
        failed, before their actors are killed.
    """

    def __init__(self, num_workers: int, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 resources_per_worker: dict | None = None, placement_strategy: str = "PACK",
                 env: dict | None = None, min_workers: int | None = None, max_restarts: int = 0,
                 start_timeout: float = 300.0, grace: float = 30.0):
        _check_number("num_workers", num_workers, 1, integer=True)
        _check_number("cpus_per_worker", cpus_per_worker, 0)
        _check_number("gpus_per_worker", gpus_per_worker, 0)
        _check_number("max_restarts", max_restarts, 0, integer=True)
        _check_number("start_timeout", start_timeout, 0)
        _check_number("grace", grace, 0)
        if start_timeout <= 0:
            raise ValueError(f"RayExecutor(start_timeout={start_timeout!r}): must be > 0")
        if min_workers is None:
            min_workers = num_workers
        _check_number("min_workers", min_workers, 1, integer=True)
        if min_workers > num_workers:
            raise ValueError(f"RayExecutor(min_workers={min_workers}): must be <= num_workers={num_workers}")
        if max_restarts and min_workers == num_workers:
            raise ValueError("RayExecutor(max_restarts=...) needs an elastic job: min_workers < num_workers")
        if not isinstance(placement_strategy, str) or placement_strategy.upper() not in STRATEGIES:
            raise ValueError(f"RayExecutor(placement_strategy={placement_strategy!r}): choose one of "
                             f"{', '.join(STRATEGIES)}")
        resources = dict(resources_per_worker or {})
        for key, value in resources.items():
            if key in ("CPU", "GPU"):
                raise ValueError(f"RayExecutor(resources_per_worker={{{key!r}: ...}}): give CPUs and GPUs as "
                                 "cpus_per_worker and gpus_per_worker")
            _check_number(f"resources_per_worker[{key!r}]", value, 0)
        env = dict(env or {})
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"RayExecutor(env=...): names and values must be strings, not {key!r}: {value!r}")
        self.num_workers, self.min_workers, self.max_restarts = num_workers, min_workers, max_restarts
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        self.resources_per_worker, self.placement_strategy = resources, placement_strategy.upper()
        self.env, self.start_timeout, self.grace = env, start_timeout, grace
        self.elastic = min_workers < num_workers
        self.workers: list[_Slot] = []
        self.lost: list[tuple[str, str]] = []  # (worker id, why) of every worker lost, in order
        self.restarts = 0
        self._pg = None
        self._server: RendezvousServer | None = None
        self._secret = ""
        self._serial = 0
        self._broken: str | None = None  # why the ring cannot run another function

    @property
    def actors(self) -> list:
        """The workers' Ray actor handles, in rank order (of the last ring formed)."""
        return [s.actor for s in self.workers]

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Places the workers and forms their ring. Raises (and leaves
        nothing behind) if the placement group cannot be placed within
        start_timeout or the ring does not form."""
        if self.workers:
            raise RingReduceError("RayExecutor.start(): already started (shutdown() first)")
        if not ray.is_initialized():
            ray.init()
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> None:
        bundle = {"CPU": self.cpus_per_worker, **self.resources_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        bundle = {k: v for k, v in bundle.items() if v}
        if not bundle:  # a bundle must hold something: a worker of no resources takes a sliver of a CPU
            bundle = {"CPU": 0.001}
        self._bundle = bundle
        self._pg = placement_group([dict(bundle) for _ in range(self.num_workers)], strategy=self.placement_strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.start_timeout)
        if not ready:
            raise RingReduceError(
                f"RayExecutor: the placement group of {self.num_workers} bundle(s) of {bundle} "
                f"({self.placement_strategy}) was not placed within {self.start_timeout:g} s: the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free")
        self.workers = [self._new_slot(i) for i in range(self.num_workers)]
        places = self._get([s.actor.where.remote() for s in self.workers], "report where it runs")
        for slot, place in zip(self.workers, places):
            slot.node_id, slot.ip = place["node_id"], place["ip"]
        # ranks on one node next to each other (they share memory links), nodes in the order of their first bundle
        order = {}
        for slot in self.workers:
            order.setdefault(slot.node_id, len(order))
        self.workers.sort(key=lambda s: (order[s.node_id], s.bundle))
        self._secret = secrets.token_hex(32)
        if self.elastic:
            here = ray.util.get_node_ip_address()
            self._server = RendezvousServer(self._secret.encode(), expected=self.num_workers,
                                            min_np=self.min_workers, max_np=self.num_workers,
                                            bind_host="127.0.0.1" if here in LOOPBACK else "0.0.0.0")
            self._rendezvous = f"{here}:{self._server.port}"
            envs = [self._elastic_env(s) for s in self.workers]
        else:
            port = self._get([self.workers[0].actor.free_port.remote()], "pick a port")[0]
            envs = self._static_env(port)
        joined = self._get([s.actor.join.remote(env) for s, env in zip(self.workers, envs)], "join the ring")
        for slot, (rank, _) in zip(self.workers, joined):
            slot.rank = rank
        self.workers.sort(key=lambda s: s.rank)  # elastic: the rendezvous gave the ranks
        self._broken = None

    def _new_slot(self, bundle: int) -> _Slot:
        self._serial += 1
        options = dict(scheduling_strategy=PlacementGroupSchedulingStrategy(
                           placement_group=self._pg, placement_group_bundle_index=bundle),
                       num_cpus=self._bundle.get("CPU", 0), num_gpus=self._bundle.get("GPU", 0),
                       resources={k: v for k, v in self._bundle.items() if k not in ("CPU", "GPU")} or None,
                       max_restarts=0, max_task_retries=0)
        actor = _remote_worker().options(**options).remote()
        return _Slot(actor, bundle, f"ray#{self._serial}")

    def _static_env(self, port: int) -> list[dict]:
        rank0 = self.workers[0].ip
        host = f"[{rank0}]" if ":" in rank0 else rank0
        local: dict[str, list[int]] = {}
        for rank, slot in enumerate(self.workers):
            local.setdefault(slot.node_id, []).append(rank)
        envs = []
        for rank, slot in enumerate(self.workers):
            env = {**self.env, "RINGREDUCE_RANK": str(rank), "RINGREDUCE_SIZE": str(self.num_workers),
                   "RINGREDUCE_ADDR": f"{host}:{port}", "RINGREDUCE_SECRET": self._secret,
                   "RINGREDUCE_LOCAL_RANK": str(local[slot.node_id].index(rank)),
                   "RINGREDUCE_LOCAL_SIZE": str(len(local[slot.node_id]))}
            envs.append(env)
        return envs

    def _elastic_env(self, slot: _Slot) -> dict:
        return {**self.env, "RINGREDUCE_ELASTIC_ADDR": self._rendezvous, "RINGREDUCE_SECRET": self._secret,
                "RINGREDUCE_WORKER_ID": slot.worker_id}

    def _get(self, refs: list, what: str) -> list:
        """ray.get of one call per worker, under start_timeout; a failure
        names the worker (its index among self.workers is its rank once
        ranks are given)."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout)
        out, errors = [], {}
        for i, ref in enumerate(refs):
            if ref not in ready:
                errors[i] = TimeoutError(f"did not {what} within {self.start_timeout:g} s")
                out.append(None)
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                errors[i] = ActorDied(_died_reason(exc))
                out.append(None)
            except ray.exceptions.RayTaskError as exc:
                errors[i] = exc.cause if isinstance(exc.cause, BaseException) else exc
                out.append(None)
        if errors:
            text = "; ".join(f"worker {i}: {_describe(e)}" for i, e in sorted(errors.items()))
            first = min(errors)
            raise WorkerFailedError(f"RayExecutor.start(): {len(errors)} of {len(refs)} worker(s) failed to "
                                    f"{what}: {text}", first, errors) from errors[first]
        return out

    def shutdown(self) -> None:
        """Ends every worker's actor and frees the placement group (and the
        elastic rendezvous). Safe to call more than once."""
        for slot in self.workers:
            try:
                ray.kill(slot.actor)
            except Exception:  # already dead, or Ray is gone
                pass
        self.workers = []
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ run

    def run(self, fn, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None) -> list:
        """Calls fn(*args, **kwargs) on every worker at once and returns the
        results in rank order (elastic: the ranks of the last ring formed,
        lost workers left out). A worker whose actor dies, or whose function
        raises, fails the run: WorkerLostError / WorkerFailedError, raised
        once the other ranks ended (they see the loss as PeerLostError) or
        `grace` seconds passed (then their actors are killed too), naming
        the rank at fault and every rank's error. `timeout`: seconds for
        the whole run, past which every worker is killed and it raises."""
        if not callable(fn):
            raise TypeError(f"RayExecutor.run(fn={fn!r}): fn must be callable")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"RayExecutor.run(args={args!r}): args must be a tuple or list")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"RayExecutor.run(kwargs={kwargs!r}): kwargs must be a dict")
        if timeout is not None:
            _check_number("run timeout", timeout, 0)
        if not self.workers:
            raise RingReduceError("RayExecutor.run(): not started (call start() first)")
        if self._broken:
            raise RingReduceError(f"RayExecutor.run(): {self._broken}; shutdown() and start() again")
        fn_ref = ray.put(fn)
        for slot in self.workers:
            slot.ref = slot.actor.execute.remote(fn_ref, tuple(args), dict(kwargs or {}))
        if self.elastic:
            return self._watch_elastic(fn_ref, tuple(args), dict(kwargs or {}), timeout)
        return self._watch(timeout)

    def _wait_one(self, refs: list, until: float | None) -> list:
        """The refs of those finished, waiting until one is (or `until`)."""
        left = None if until is None else max(0.0, until - time.monotonic())
        ready, _ = ray.wait(refs, num_returns=1, timeout=left)
        return ready

    def _outcome(self, slot: _Slot):
        """(result, None) or (None, the exception) of slot's finished call."""
        try:
            return ray.get(slot.ref), None
        except ray.exceptions.RayActorError as exc:
            slot.lost = _died_reason(exc)
            return None, ActorDied(slot.lost)
        except ray.exceptions.RayTaskError as exc:
            return None, (exc.cause if isinstance(exc.cause, BaseException) else exc)

    def _watch(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {slot.ref: rank for rank, slot in enumerate(self.workers)}
        results, errors, failed_at = {}, {}, None
        while pending:
            until = deadline if failed_at is None else min(deadline or math.inf, failed_at + self.grace)
            ready = self._wait_one(list(pending), None if until == math.inf else until)
            if not ready:
                break
            for ref in ready:
                rank = pending.pop(ref)
                result, error = self._outcome(self.workers[rank])
                if error is None:
                    results[rank] = result[1]
                else:
                    errors[rank] = error
                    failed_at = failed_at or time.monotonic()
        if not pending and not errors:
            return [results[r] for r in range(len(self.workers))]
        for ref, rank in pending.items():  # past the grace (or the run's timeout): ended here
            errors[rank] = TimeoutError(
                f"still running {self.grace:g} s after rank {min(errors)} failed; its actor was killed"
                if errors else f"still running when the run's timeout ({timeout:g} s) passed; its actor was killed")
            ray.kill(self.workers[rank].actor)
            self.workers[rank].lost = "killed by the executor"
        raise self._failure(errors, results)

    def _failure(self, errors: dict, results: dict) -> WorkerFailedError:
        """The exception for a failed run: the rank at fault first, then everyone's."""
        lost = sorted(r for r, e in errors.items() if isinstance(e, ActorDied))
        own = sorted(r for r, e in errors.items() if not isinstance(e, (ActorDied, PeerLostError, TimeoutError)))
        culprit = (lost or own or sorted(errors))[0]
        size = len(self.workers)
        others = "; ".join(f"rank {r}: {_describe(e)}" for r, e in sorted(errors.items()) if r != culprit)
        if isinstance(errors[culprit], ActorDied):
            head = f"rank {culprit} of {size} was lost: its Ray actor died ({errors[culprit]})"
            cls = WorkerLostError
        else:
            head = f"rank {culprit} of {size} failed: {_describe(errors[culprit])}"
            cls = WorkerFailedError
        self._broken = f"a run failed ({head})"
        if lost or any(s.lost for s in self.workers):
            self._broken += "; a worker's actor is gone"
        else:  # every actor lives: leave the broken ring on each, and form a new one before the next run
            self._reform_after_failure()
        msg = f"ringreduce.ray: {head}" + (f". Other ranks: {others}" if others else "")
        exc = cls(msg, culprit, errors, results)
        exc.__cause__ = errors[culprit] if not isinstance(errors[culprit], ActorDied) else None
        return exc

    def _reform_after_failure(self) -> None:
        """After a function raised (every actor alive): each leaves the
        broken ring and a new ring forms, so the next run starts clean."""
        try:
            self._get([s.actor.leave.remote() for s in self.workers], "leave the ring")
            port = self._get([self.workers[0].actor.free_port.remote()], "pick a port")[0]
            self._get([s.actor.join.remote(env) for s, env in zip(self.workers, self._static_env(port))],
                      "join the ring")
            self._broken = None
        except RingReduceError as exc:
            self._broken += f"; the ring could not be formed again ({exc})"

    # ------------------------------------------------------------------ elastic

    def _watch_elastic(self, fn_ref, args: tuple, kwargs: dict, timeout: float | None) -> list:
        """Waits for every live worker; a lost one leaves the ring to its
        peers' elastic reset (ringreduce.elastic.run), and is replaced while
        restarts are left. Fails once fewer than min_workers live."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, tuple] = {}   # worker id -> (rank at the end, result)
        errors: dict[str, BaseException] = {}
        while True:
            running = [s for s in self.workers if s.ref is not None]
            if not running:
                break
            finished_all = [s for s in self.workers if not s.newcomer and s.ref is None and s.lost is None]
            waiting = self._server.joiners({s.worker_id for s in running if s.newcomer})
            if finished_all and waiting:
                # training is over: a newcomer still waiting for a commit that will not come is stopped
                for s in running:
                    if s.worker_id in waiting:
                        ray.kill(s.actor)
                        s.ref, s.lost = None, "stopped: training finished before it joined"
                continue
            ready = self._wait_one([s.ref for s in running], deadline)
            if not ready:
                for s in running:
                    ray.kill(s.actor)
                    s.ref, s.lost = None, "killed by the executor"
                    errors[s.worker_id] = TimeoutError(f"still running when the run's timeout ({timeout:g} s) "
                                                        "passed; its actor was killed")
                break
            slot = next(s for s in running if s.ref == ready[0])
            result, error = self._outcome(slot)
            slot.ref = None
            if error is None:
                results[slot.worker_id] = result
                continue
            if isinstance(error, ActorDied):
                self.lost.append((slot.worker_id, slot.lost))
                alive = [s for s in self.workers if s.lost is None]
                log.warning("ringreduce.ray: worker %s (rank %d) was lost: %s; %d worker(s) go on",
                            slot.worker_id, slot.rank, slot.lost, len(alive))
                if self.restarts < self.max_restarts:
                    self._replace(slot, fn_ref, args, kwargs)
                    continue
                if len(alive) >= self.min_workers:
                    continue
                errors[slot.worker_id] = error
            else:
                errors[slot.worker_id] = error
            # a program error, or too few left: the job ends
            for s in self.workers:
                if s.ref is not None:
                    ray.kill(s.actor)
                    s.ref, s.lost = None, "killed by the executor"
            break
        if errors:
            self._broken = "an elastic run failed"
            by_rank = {s.rank: errors[s.worker_id] for s in self.workers if s.worker_id in errors}
            rank, first = min(by_rank.items()) if by_rank else (None, next(iter(errors.values())))
            detail = "; ".join(f"worker {w}: {_describe(e)}" for w, e in errors.items())
            if isinstance(first, ActorDied):
                exc = WorkerLostError(f"ringreduce.ray: elastic job lost rank {rank} and fewer than min_workers="
                                      f"{self.min_workers} remain: {detail}", rank, by_rank)
            else:
                exc = WorkerFailedError(f"ringreduce.ray: elastic job failed on rank {rank}: {detail}", rank, by_rank)
                exc.__cause__ = first
            raise exc
        self.workers = [s for s in self.workers if s.lost is None]
        for s in self.workers:
            s.rank, s.newcomer = results[s.worker_id][0], False
        self.workers.sort(key=lambda s: s.rank)
        return [results[s.worker_id][1] for s in self.workers]

    def _replace(self, lost: _Slot, fn_ref, args: tuple, kwargs: dict) -> None:
        """A new actor in the lost one's bundle: it registers with the
        rendezvous and joins the ring at its next commit."""
        self.restarts += 1
        slot = self._new_slot(lost.bundle)
        slot.newcomer = True
        self.workers.append(slot)
        slot.ref = slot.actor.join_and_execute.remote(self._elastic_env(slot), fn_ref, args, kwargs)
        log.warning("ringreduce.ray: started worker %s in place of %s (restart %d of %d)",
                    slot.worker_id, lost.worker_id, self.restarts, self.max_restarts)
