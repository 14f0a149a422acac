"""The names the TF ops give their collectives: the background engine pairs
collectives across ranks BY NAME (ringreduce/engine/scheduler.py), so a name must be
the same on every rank and unique among the collectives that may be in
flight at once (per process set: the engine keys requests by set and name).

- name= given by the caller: that name, as Horovod uses it.
- Inside tf.function: a name fixed when the function is traced, from the
  chain of FuncGraphs the op is built in (their names without TensorFlow's
  process-wide numbering, which need not match across ranks) and the op's
  unique name in its graph (name scopes included): the same on every rank
  that traces the same function, distinct for every collective the graph
  holds. One tf.function run from two threads at once would pair its own
  names: give such ops name= of their own.
- Eagerly: the kind and a sequence number per kind and process set, as
  Horovod's eager ops are paired by issue order: ranks that issue unnamed
  eager collectives of a kind in the same order pair them right (from
  several threads at once, give them name=).
"""
from __future__ import annotations

import itertools
import re
import threading

import tensorflow as tf

_counters: dict = {}
_lock = threading.Lock()
_UID = re.compile(r"_\d+$")


@tf.autograph.experimental.do_not_convert
def collective_name(kind: str, name, process_set) -> str:
    """The engine's name for a collective of `kind` built now."""
    if name:
        return str(name)
    if tf.executing_eagerly():
        key = (kind, process_set.process_set_id, tuple(process_set.ranks))
        with _lock:
            counter = _counters.setdefault(key, itertools.count(1))
            return f"{kind}.{next(counter)}"
    graph = tf.compat.v1.get_default_graph()
    op_name = graph.unique_name(f"Ring{kind}")
    chain = []
    while graph is not None:
        if getattr(graph, "name", ""):  # a FuncGraph's; the outermost tf.Graph has none
            chain.append(_UID.sub("", graph.name))
        graph = getattr(graph, "outer_graph", None)
    return "/".join(reversed(chain)) + "/" + op_name
