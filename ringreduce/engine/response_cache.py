"""The engine's response cache, after Horovod's (horovod/common/response_cache.cc):
a request agreed once gets a slot number, the same on every rank, so later
cycles send one bit for it instead of its name, kind, dtype and shape.

Every rank holds an identical cache because every change is made from data
every rank holds alike: slots are given to newly agreed requests in agreed
order, used slots move to the back of the eviction order in agreed order,
and a name whose request changed (or failed to agree) loses its slot on
every rank in the same cycle. Nothing here talks to other ranks.
"""
from __future__ import annotations

from collections import OrderedDict


class ResponseCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slot_of: OrderedDict[tuple, int] = OrderedDict()  # key -> slot, least recently used first
        self._key_at: dict[int, tuple] = {}
        self._slot_by_name: dict[tuple, int] = {}  # (process_set, name) -> slot: one key per name
        self._free: list[int] = []  # slots given back by eviction, reused lowest first
        self._next = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def width(self) -> int:
        """Bits a ready vector needs: one per slot number handed out."""
        return self._next

    def slot(self, key: tuple) -> int | None:
        return self._slot_of.get(key)

    def key(self, slot: int) -> tuple:
        return self._key_at[slot]

    def slot_for_name(self, process_set: int, name: str) -> int | None:
        return self._slot_by_name.get((process_set, name))

    def put(self, key: tuple) -> None:
        """Records an agreed request (key[0] is its name, key[-1] its process
        set): a new name gets a slot, a known key moves to the back of the
        eviction order, a changed request under a known name replaces it."""
        if self.capacity == 0:
            return
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        self.invalidate(key[-1], key[0])
        if len(self._slot_of) >= self.capacity:
            oldest, slot = next(iter(self._slot_of.items()))
            self._drop(oldest, slot)
        if self._free:
            slot = min(self._free)
            self._free.remove(slot)
        else:
            slot, self._next = self._next, self._next + 1
        self._slot_of[key] = slot
        self._key_at[slot] = key
        self._slot_by_name[(key[-1], key[0])] = slot

    def invalidate(self, process_set: int, name: str) -> None:
        slot = self._slot_by_name.get((process_set, name))
        if slot is not None:
            self._drop(self._key_at[slot], slot)

    def _drop(self, key: tuple, slot: int) -> None:
        del self._slot_of[key]
        del self._key_at[slot]
        del self._slot_by_name[(key[-1], key[0])]
        self._free.append(slot)
