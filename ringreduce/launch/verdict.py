"""One sentence on where a failed job's ranks were, from their flight
recorder dumps (ringreduce/core/flight_recorder.py): ringrun prints it after
a failed job, `ringrun --postmortem DIR` for a finished one.

    verdict({0: dump0, 1: dump1, 2: dump2}, size=3)
    -> "rank 2 never started allreduce 'grad/w' #12; ranks 0-1 are waiting in it"

Pure: parsed dumps in, a string out (None when there is nothing to say).
Each rank's *position* is the collective it was in when it dumped: the
oldest entry it started and did not finish (or that failed, with nothing
begun after it), else the oldest request still waiting in the engine. Ranks
at the same position (process set, kind, number, name) are grouped; the
verdict names the ranks that are elsewhere, or in nothing while others wait
for them (only members of a process set are waited for in its
collectives), or, when every rank is in one collective, how it ended.
"""
from __future__ import annotations

OPEN = ("enqueued", "started", "failed")


def ranks_text(ranks) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j > i + 1 else
                     (f"{ranks[i]}, {ranks[j]}" if j == i + 1 else f"{ranks[i]}"))
        i = j + 1
    return "ranks " + ", ".join(parts)


def position(dump: dict):
    """The entry this rank was in when it dumped, or None (in no collective)."""
    entries = dump.get("entries") or []
    if not entries:
        return None
    begun = [e.get("t_start") if e.get("t_start") is not None else e.get("t_enqueue") for e in entries]
    latest = max((t for t in begun if t is not None), default=None)

    def is_open(e):
        if e.get("state") not in OPEN:
            return False
        if e["state"] == "failed":  # where it stopped only if nothing began after the failure
            return latest is None or e.get("t_end") is None or e["t_end"] >= latest
        return True

    live = [e for e in entries if is_open(e)]
    if not live:
        return None
    started = [e for e in live if e.get("t_start") is not None]
    return min(started or live, key=lambda e: e.get("id", 0))


def _key(e):
    return (e.get("process_set", 0), e.get("kind"), e.get("seq"), e.get("name"))


def describe(e, sets: dict | None = None, world: bool = False) -> str:
    """"allreduce 'grad/w' #12", with " of process set 1 (ranks 1, 2)" for a
    set's, and " of the world" for the world's when `world`."""
    text = e.get("kind") or "collective"
    if e.get("name"):
        text += f" {e['name']!r}"
    if e.get("seq") is not None:
        text += f" #{e['seq']}"
    ps = e.get("process_set", 0)
    if ps:
        members = (sets or {}).get(str(ps))
        text += f" of process set {ps}" + (f" ({ranks_text(members)})" if members else "")
    elif world:
        text += " of the world"
    if e.get("seq") is None and e.get("state") in ("enqueued", "failed") and e.get("t_start") is None:
        text += " (in the engine, not yet agreed)"
    return text


def _last_of(dump: dict, e) -> str | None:
    """What this rank last finished of e's process set and kind."""
    done = [x for x in dump.get("entries") or [] if x.get("state") == "done"
            and x.get("process_set", 0) == e.get("process_set", 0) and x.get("kind") == e.get("kind")]
    return f"its last was {describe(done[-1])}" if done else None


def _error(e) -> str:
    text = (e.get("error") or "").splitlines()
    return text[0][:300] if text else ""


def verdict(dumps: dict, size: int | None = None) -> str | None:
    """dumps: {rank: parsed dump}. size: the world's size (default: from the dumps)."""
    if not dumps:
        return None
    if size is None:
        size = max([d.get("size") or 0 for d in dumps.values()] + [max(dumps) + 1])
    sets: dict = {}
    for d in dumps.values():
        sets.update(d.get("process_sets") or {})
    missing = [r for r in range(size) if r not in dumps]
    where = {r: position(d) for r, d in dumps.items()}
    idle = sorted(r for r, e in where.items() if e is None)
    groups: dict = {}
    for r, e in sorted(where.items()):
        if e is not None:
            groups.setdefault(_key(e), []).append(r)
    absent = f"; {ranks_text(missing)} wrote no flight record" if missing else ""
    if not groups:
        return ("no rank was inside a collective when it dumped: the failure came from outside ringreduce's "
                "collectives" + absent)

    def members(e):
        ps = e.get("process_set", 0)
        return set(range(size)) if not ps else set(sets.get(str(ps), range(size)))

    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    (main_key, main_ranks), others = ordered[0], ordered[1:]
    main = where[main_ranks[0]]
    if not others:
        expected = members(main)
        never = [r for r in idle if r in expected]
        unknown = [r for r in missing if r in expected]
        if never or unknown:
            parts = []
            if never:
                verb = "never enqueued" if main.get("seq") is None else "never started"
                lasts = [_last_of(dumps[r], main) for r in never]
                last = f" ({lasts[0]})" if len(never) == 1 and lasts[0] else ""
                parts.append(f"{ranks_text(never)} {verb} {describe(main, sets)}{last}")
            if unknown:
                parts.append(f"{ranks_text(unknown)} wrote no flight record (ended or unreachable before it could)")
            waiting = "are waiting" if len(main_ranks) > 1 else "is waiting"
            text = "; ".join(parts) + f"; {ranks_text(main_ranks)} {waiting} in " + (
                "it" if never else describe(main, sets))
            error = _error(main)
            return text + (f" ({error})" if error and main.get("state") == "failed" else "")
        failed = [r for r in main_ranks if (where[r].get("state") == "failed")]
        who = "every rank" if len(main_ranks) == size else ranks_text(main_ranks)
        if failed:
            return f"{who} failed in {describe(main, sets)}: {_error(where[failed[0]])}" + absent
        return f"{who} is in {describe(main, sets)} and none finished it" + absent
    parts = []
    mixed = len({key[0] for key in groups}) > 1  # process sets differ: name the world's too
    for key, ranks in others:
        e = where[ranks[0]]
        verb = "are" if len(ranks) > 1 else "is"
        parts.append(f"{ranks_text(ranks)} {verb} in {describe(e, sets, mixed)}")
    everyone = len(main_ranks) + sum(len(r) for _, r in others) == size
    rest = "the others" if everyone and len(others) == 1 and len(main_ranks) > 1 else ranks_text(main_ranks)
    verb = "are" if len(main_ranks) > 1 or rest == "the others" else "is"
    text = "; ".join(parts) + f" while {rest} {verb} in {describe(main, sets, mixed)}"
    if idle:
        text += f"; {ranks_text(idle)} {'are' if len(idle) > 1 else 'is'} in no collective"
    return text + absent
