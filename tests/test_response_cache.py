"""The response cache and the agreement rule, in one process: every rank
runs this same code on the same messages, so what is checked here is what
keeps their caches identical."""
from ringreduce.engine.negotiation import Message, agree, decode, encode
from ringreduce.engine.response_cache import ResponseCache


def key(name, shape=(4,), kind="allreduce", dtype="float32", op="avg", root=0, ps=0):
    return (name, kind, dtype, tuple(shape), op, root, ps)


def message(cache, keys, joined=False):
    return decode(encode(keys, joined, cache))


def test_slots_are_given_in_agreed_order_and_reused_after_eviction():
    c = ResponseCache(3)
    for n in "abc":
        c.put(key(n))
    assert [c.slot(key(n)) for n in "abc"] == [0, 1, 2]
    c.put(key("a"))  # used again: b is now the least recently used
    c.put(key("d"))
    assert c.slot(key("b")) is None and c.slot(key("d")) == 1 and c.width == 3 and len(c) == 3


def test_a_changed_request_under_a_cached_name_replaces_its_slot():
    c = ResponseCache(8)
    c.put(key("w", (4,)))
    c.put(key("v"))
    c.put(key("w", (5,)))
    assert c.slot(key("w", (4,))) is None
    assert c.slot_for_name(0, "w") == c.slot(key("w", (5,))) == 0  # the freed slot, lowest first
    assert len(c) == 2


def test_capacity_zero_holds_nothing_and_sends_everything_in_full():
    c = ResponseCache(0)
    c.put(key("a"))
    assert len(c) == 0 and c.slot(key("a")) is None
    assert message(c, [key("a")]).entries == {(0, "a"): key("a")}


def test_cached_requests_travel_as_bits_and_cost_far_fewer_bytes():
    c = ResponseCache(1024)
    keys = [key(f"layer{i}/kernel", (300, 70)) for i in range(100)]
    full = encode(keys, False, c)
    for k in keys:
        c.put(k)
    bits = encode(keys, False, c)
    assert len(bits) < 20 < 4000 < len(full)
    m = decode(bits)
    assert m.bits == (1 << 100) - 1 and m.entries == {} and not m.joined


def test_ready_set_is_the_and_of_the_vectors_in_slot_order():
    caches = [ResponseCache(16) for _ in range(3)]
    keys = [key(n) for n in "abcd"]
    for c in caches:
        for k in keys:
            c.put(k)
    ready = [["a", "b", "c"], ["c", "b"], ["d", "b", "c"]]
    results = []
    for c in caches:
        msgs = [message(c, [key(n) for n in names]) for names in ready]
        results.append(agree(msgs, c))
    for out in results:
        assert out.run == [key("b"), key("c")] and out.failed == []


def test_a_new_request_meets_a_cached_one_under_its_name_and_fails_everywhere():
    caches = [ResponseCache(16) for _ in range(2)]
    for c in caches:
        c.put(key("w", (4,)))
    for c in caches:
        msgs = [message(c, [key("w", (4,))]), message(c, [key("w", (5,))])]  # rank 1 changed shape
        out = agree(msgs, c)
        assert out.run == [] and len(out.failed) == 1
        text = out.failed[0][1]
        assert "'w'" in text and "rank 0" in text and "rank 1" in text and "(5,)" in text
        assert c.slot_for_name(0, "w") is None, "a mismatched name must lose its slot on every rank"


def test_a_joined_rank_counts_as_ready_for_allreduce_only():
    c = ResponseCache(16)
    msgs = [message(c, [], joined=True),
            message(c, [key("a"), key("g", (-1, 3), kind="allgather", op="")]),
            message(c, [key("a"), key("g", (-1, 3), kind="allgather", op="")])]
    out = agree(msgs, c)
    assert out.run == [key("a")] and out.joined == [0]
    assert [k[0] for k, _ in out.failed] == ["g"] and "joined" in out.failed[0][1]


def test_when_every_rank_has_joined_what_anyone_still_has_runs():
    c = ResponseCache(16)
    out = agree([message(c, [key("a")], joined=True), message(c, [], joined=True)], c)
    assert out.run == [key("a")]


def test_a_message_decodes_to_what_was_encoded():
    c = ResponseCache(16)
    c.put(key("cached"))
    ks = [key("cached"), key("new", (2, 3), kind="broadcast", op="", root=1)]
    m = message(c, ks, joined=True)
    assert m.joined and m.bits == 1 and list(m.entries.values()) == [ks[1]]
    assert isinstance(m, Message)
