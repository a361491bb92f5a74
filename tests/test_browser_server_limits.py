"""The browser server's limits as pure code: the caps and their reservations, the per-connection
accounting (objects, contexts, calls in flight, idle clocks), the reader of server messages, the memory
cgroup's parsing, the options; and the sandbox refusals of the protocol filter. The real server under
load is ``test_browser_server_load.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from browser.caps import CapRefusal, Caps, Slot
from browser.cgroup import (
    MIN_CEILING,
    BrowserCgroup,
    CgroupError,
    MemoryCeiling,
    locate,
    parse_memory_size,
    parse_mountinfo,
    parse_proc_cgroup,
)
from browser.metrics import BrowserMetrics
from browser.objects import ObjectTree, read_server_message
from browser.protocol_filter import ProtocolFilter
from browser.server import ServerLimits, client_key
from browser.tracker import ConnectionTracker

# ---- caps ----------------------------------------------------------------------------------------


def test_caps_refuse_with_the_reason_and_count_reservations():
    caps = Caps(limit=3, per_client=2)
    a1, a2 = caps.reserve("a"), caps.reserve("a")
    assert isinstance(a1, Slot) and isinstance(a2, Slot)
    refused = caps.reserve("a")
    assert refused == CapRefusal("client", "2 of 2 contexts in use for this client; close one")
    b1 = caps.reserve("b")
    assert isinstance(b1, Slot)
    refused = caps.reserve("c")
    assert isinstance(refused, CapRefusal) and refused.scope == "server"
    assert refused.reason == "3 of 3 contexts in use on this server; try again later"
    a1.release()
    a1.release()  # idempotent: a context both closed and reaped frees one slot
    assert caps.in_use == 2 and caps.held_by("a") == 1
    assert isinstance(caps.reserve("c"), Slot)


def test_caps_must_be_positive():
    with pytest.raises(ValueError):
        Caps(limit=0, per_client=1)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 6), per_client=st.integers(1, 6),
       steps=st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 20)), max_size=80))
def test_caps_never_overshoot_and_give_every_slot_back(limit, per_client, steps):
    """Any interleaving of reservations and releases (by several clients) stays within both caps, the
    refusal names the cap that was full, and after everything is released nothing is held."""
    caps = Caps(limit, per_client)
    held: list[Slot] = []
    for reserve, client, pick in steps:
        if reserve:
            before_total, before_mine = caps.in_use, caps.held_by(str(client))
            slot = caps.reserve(str(client))
            if isinstance(slot, CapRefusal):
                assert before_mine >= per_client if slot.scope == "client" else before_total >= limit
                assert caps.in_use == before_total
            else:
                held.append(slot)
        elif held:
            held.pop(pick % len(held)).release()
        assert caps.in_use == len(held) <= limit
        assert all(n <= per_client for n in caps.by_client.values())
    for slot in held:
        slot.release()
    assert caps.in_use == 0 and caps.by_client == {}


# ---- reading the server's messages ---------------------------------------------------------------


def create(parent: str, kind: str, guid: str) -> str:
    return json.dumps({"guid": parent, "method": "__create__", "params": {"type": kind, "initializer": {},
                                                                          "guid": guid}}, separators=(",", ":"))


def test_replies_are_read_by_their_prefix_and_events_by_guid_and_method():
    big = '{"id":"abcd@7","result":{"binary":"' + "A" * 2_000_000 + '"}}'
    message = read_server_message(big)
    assert message.call_id == "abcd@7" and message.ok and message.result is None
    assert read_server_message('{"id":12,"error":{"error":{"message":"x"}}}').ok is False
    assert read_server_message('{"id":-3}').call_id == -3
    wanted = read_server_message('{"id":"c@1","result":{"context":{"guid":"browser-context@1"}}}', {"c@1"})
    assert wanted.result == {"context": {"guid": "browser-context@1"}}
    event = read_server_message('{"guid":"page@1","method":"close","params":{}}')
    assert (event.guid, event.method, event.call_id) == ("page@1", "close", None)
    created = read_server_message(create("browser@1", "BrowserContext", "browser-context@2"))
    assert created.method == "__create__" and created.params["guid"] == "browser-context@2"
    # another key order, or spacing, is parsed whole and read the same
    spaced = read_server_message('{ "result": {}, "id": 5 }')
    assert spaced.call_id == 5
    assert read_server_message(b"\x00").call_id is None and read_server_message("not json").method is None


ids = st.one_of(st.integers(-2**40, 2**40), st.text(max_size=30))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(call_id=ids, kind=st.sampled_from(["result", "error", "none"]), body=st.dictionaries(
    st.text(max_size=8), json_values, max_size=3), compact=st.booleans(), wanted=st.booleans())
def test_the_prefix_reading_of_a_reply_agrees_with_parsing_it(call_id, kind, body, compact, wanted):
    """However the id is spelled (escapes, quotes, negative numbers) and whatever the reply holds, the
    cheap reading gives what parsing the whole message gives."""
    message: dict = {"id": call_id}
    if kind != "none":
        message[kind] = body
    text = json.dumps(message, separators=(",", ":") if compact else None)
    seen = read_server_message(text, {call_id} if wanted else ())
    assert seen.call_id == call_id and seen.ok == (kind != "error") and seen.method is None
    assert seen.result == (body if wanted and kind == "result" else None)


@settings(max_examples=300, deadline=None)
@given(guid=st.text(max_size=40), method=st.text(max_size=20), params=st.dictionaries(st.text(max_size=8),
                                                                                      json_values, max_size=3))
def test_the_prefix_reading_of_an_event_agrees_with_parsing_it(guid, method, params):
    seen = read_server_message(json.dumps({"guid": guid, "method": method, "params": params}, separators=(",", ":")))
    assert (seen.call_id, seen.guid, seen.method) == (None, guid, method)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["create", "adopt", "dispose"]), st.integers(0, 8), st.integers(0, 8)),
                max_size=60))
def test_the_object_tree_stays_a_tree(steps):
    tree = ObjectTree()
    for action, a, b in steps:
        guid, other = f"o{a}", ("" if b == 0 else f"o{b}")
        if action == "create":
            tree.create(guid, "Page", other)
        elif action == "adopt":
            tree.adopt(guid, other)
        else:
            tree.dispose(guid)
        for child, parent in tree.parents.items():
            assert child in tree.types and parent in tree.types
        for guid in tree.types:  # no cycles: every chain ends at the root or an orphan
            seen, current = set(), guid
            while current in tree.parents:
                assert current not in seen
                seen.add(current)
                current = tree.parents[current]


def test_the_object_tree_follows_create_adopt_and_dispose():
    tree = ObjectTree()
    for parent, kind, guid in (("", "Playwright", "pw"), ("pw", "Browser", "b"), ("b", "BrowserContext", "ctx"),
                               ("ctx", "Page", "p"), ("p", "Frame", "f"), ("f", "ElementHandle", "h")):
        tree.observe(read_server_message(create(parent, kind, guid)))
    assert tree.ancestor_of_type("h", "BrowserContext") == "ctx"
    assert tree.ancestor_of_type("b", "BrowserContext") is None
    tree.observe(read_server_message(json.dumps({"guid": "b", "method": "__adopt__", "params": {"guid": "h"}})))
    assert tree.ancestor_of_type("h", "BrowserContext") is None
    tree.observe(read_server_message(json.dumps({"guid": "h", "method": "__adopt__", "params": {"guid": "b"}})))
    assert tree.parents["b"] == "pw"  # a cycle is not made
    removed = tree.observe(read_server_message('{"guid":"ctx","method":"__dispose__","params":{}}'))
    assert set(removed) == {"ctx", "p", "f"} and tree.type_of("f") is None and tree.type_of("h") == "ElementHandle"
    assert len(tree) == 4  # root, pw, b and h: nothing of the context is left
    assert tree.dispose("") == []


# ---- one connection's accounting -------------------------------------------------------------------


def tracked(limit: int = 4, per_client: int = 2, in_flight: int = 3) -> ConnectionTracker:
    tree = ObjectTree()
    for parent, kind, guid in (("", "Playwright", "pw"), ("pw", "Browser", "b")):
        tree.create(guid, kind, parent)
    return ConnectionTracker("client", Caps(limit, per_client), tree, in_flight, now=0.0, metrics=BrowserMetrics())


def open_context(tracker: ConnectionTracker, call_id: str, guid: str, now: float = 0.0) -> None:
    assert tracker.admit_call(call_id, "b", "newContext", now) is None
    tracker.observe(read_server_message(create("b", "BrowserContext", guid)), now)
    tracker.observe(read_server_message(json.dumps({"id": call_id, "result": {"context": {"guid": guid}}}),
                                        tracker.want_result), now)


def test_a_context_holds_its_slot_from_the_call_until_it_closes():
    tracker = tracked()
    assert tracker.admit_call("c@1", "b", "newContext", 0.0) is None
    assert tracker.caps.in_use == 1 and not tracker.contexts  # reserved, not yet open
    tracker.observe(read_server_message(create("b", "BrowserContext", "ctx1")), 0.1)
    tracker.observe(read_server_message('{"id":"c@1","result":{"context":{"guid":"ctx1"}}}', tracker.want_result), 0.2)
    assert set(tracker.contexts) == {"ctx1"} and tracker.caps.in_use == 1 and tracker.metrics.contexts_opened == 1
    open_context(tracker, "c@2", "ctx2")
    refusal = tracker.admit_call("c@3", "b", "newContext", 1.0)
    assert refusal is not None and refusal.reason == "2 of 2 contexts in use for this client; close one"
    assert "c@3" not in tracker.in_flight and tracker.metrics.contexts_refused["client"] == 1
    tracker.observe(read_server_message('{"guid":"ctx1","method":"close","params":{}}'), 2.0)
    assert set(tracker.contexts) == {"ctx2"} and tracker.caps.in_use == 1
    tracker.observe(read_server_message('{"guid":"ctx2","method":"__dispose__","params":{}}'), 2.0)
    assert tracker.caps.in_use == 0 and not tracker.contexts


def test_a_failed_open_gives_its_slot_back():
    tracker = tracked()
    assert tracker.admit_call(7, "b", "newContext", 0.0) is None
    tracker.observe(read_server_message('{"id":7,"error":{"error":{"message":"no"}}}', tracker.want_result), 0.1)
    assert tracker.caps.in_use == 0 and not tracker.contexts and not tracker.in_flight


def test_calls_in_flight_are_bounded_and_ids_are_unique():
    tracker = tracked(in_flight=2)
    open_context(tracker, "c@1", "ctx")
    tracker.tree.create("page", "Page", "ctx")
    assert tracker.admit_call("c@2", "page", "goto", 1.0) is None
    assert tracker.admit_call("c@2", "page", "goto", 1.0).scope == "call_id"
    assert tracker.admit_call("c@3", "page", "title", 1.0) is None
    refusal = tracker.admit_call("c@4", "page", "title", 1.0)
    assert refusal.scope == "in_flight" and "2 calls in flight" in refusal.reason
    assert tracker.admit_call("c@5", "page", "__waitInfo__", 1.0) is None  # never answered: not counted
    tracker.observe(read_server_message('{"id":"c@2","result":{}}'), 1.5)
    assert tracker.admit_call("c@4", "page", "title", 1.6) is None


def test_idle_is_measured_from_the_last_call_or_reply_on_the_context():
    tracker = tracked()
    open_context(tracker, "c@1", "ctx", now=0.0)
    open_context(tracker, "c@2", "other", now=0.0)
    tracker.tree.create("page", "Page", "ctx")
    tracker.tree.create("frame", "Frame", "page")
    assert tracker.admit_call("c@3", "frame", "evaluateExpression", 50.0) is None  # a call on a frame of ctx
    tracker.observe(read_server_message('{"id":"c@3","result":{}}'), 80.0)  # answered at 80
    assert [c.guid for c in tracker.idle_contexts(100.0, 60.0)] == ["other"]
    assert {c.guid for c in tracker.idle_contexts(140.0, 60.0)} == {"ctx", "other"}
    assert tracker.idle_for(140.0) == 60.0
    call_id = tracker.own_call("other", "idle")
    assert call_id < 0 and [c.guid for c in tracker.idle_contexts(140.0, 60.0)] == ["ctx"]  # not asked twice
    seen = tracker.observe(read_server_message(json.dumps({"id": call_id})), 141.0)
    assert seen.swallow and "other" not in tracker.contexts and tracker.metrics.contexts_reaped["idle"] == 1
    assert tracker.caps.in_use == 1


def test_a_context_nobody_asked_for_is_reported_and_everything_is_released_at_the_end():
    tracker = tracked()
    seen = tracker.observe(read_server_message(create("b", "BrowserContext", "sneaky")), 0.0)
    assert seen.unexpected_context == "sneaky"
    open_context(tracker, "c@1", "ctx")
    assert tracker.admit_call("c@2", "b", "newContext", 0.0) is None
    assert tracker.caps.in_use == 2
    tracker.release_all()
    assert tracker.caps.in_use == 0 and tracker.caps.by_client == {}


# ---- the protocol filter: Chromium's sandbox -----------------------------------------------------


@pytest.fixture
def protocol() -> ProtocolFilter:
    protocol = ProtocolFilter()
    for kind, guid in (("Playwright", "playwright"), ("BrowserType", "browser-type@1"), ("Browser", "browser@1"),
                       ("BrowserContext", "browser-context@1"), ("Page", "page@1"), ("Android", "android@1")):
        protocol.from_server(create("", kind, guid))
    return protocol


def call(guid: str, method: str, params: dict) -> str:
    return json.dumps({"id": "c@1", "guid": guid, "method": method, "params": params, "metadata": {}})


@pytest.mark.parametrize("guid,method,params,why", [
    ("browser-type@1", "launch", {"chromiumSandbox": False, "args": ["--no-sandbox"]}, "BrowserType"),
    ("android@1", "devices", {}, "adb"),
    ("browser@1", "newContext", {"chromiumSandbox": False}, "'chromiumSandbox': launch options are fixed"),
    ("browser@1", "newContext", {"options": {"chromiumSandbox": True}}, "sandbox is the server's setting"),
    ("browser-context@1", "newPage", {"x": {"args": ["--foo", "--no-sandbox"]}}, "'--no-sandbox'"),
    ("browser-context@1", "newPage", {"x": {"args": ["--disable-setuid-sandbox=1"]}}, "sandbox"),
    ("browser@1", "newContextForReuse", {}, "context reuse is not offered"),
])
def test_filter_refuses_a_client_turning_the_sandbox_off(protocol, guid, method, params, why):
    refusal = protocol.from_client(call(guid, method, params))
    assert refusal is not None and why in refusal.reason, refusal


def test_filter_passes_page_values_that_merely_mention_the_sandbox(protocol):
    arg = {"value": {"a": [{"s": "--no-sandbox"}]}, "handles": []}  # a page value: never an "args" key
    assert protocol.from_client(call("page@1", "evaluateExpression", {"expression": "x => x", "arg": arg})) is None
    assert protocol.from_client(call("page@1", "fill", {"selector": "#q", "value": "--no-sandbox"})) is None


# ---- the memory cgroup -----------------------------------------------------------------------------

MOUNTINFO_V1 = """\
25 30 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
33 25 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
34 25 0:29 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 25 0:35 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_mountinfo_and_proc_cgroup_are_read():
    mounts = parse_mountinfo(MOUNTINFO_V1 + "garbage line\n41 25 0:36 / /x\\040y rw - cgroup cgroup rw,cpu\n")
    assert [m.point for m in mounts] == ["/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids",
                                         "/sys/fs/cgroup/unified", "/x y"]
    assert "memory" in mounts[1].super_options and mounts[3].fstype == "cgroup2"
    paths = parse_proc_cgroup("4:memory:/job/7\n3:cpu,cpuacct:/\n0::/user.slice\nbad\n")
    assert paths == {"memory": "/job/7", "cpu": "/", "cpuacct": "/", "": "/user.slice"}


def test_locate_finds_this_process_group_or_says_why_not(tmp_path):
    (tmp_path / "memory" / "job" / "7").mkdir(parents=True)
    (tmp_path / "unified" / "user.slice").mkdir(parents=True)
    (tmp_path / "unified" / "user.slice" / "cgroup.controllers").write_text("cpu io\n")
    mountinfo = (f"33 25 0:28 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
                 f"40 25 0:35 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n")
    assert locate("4:memory:/job/7\n0::/user.slice\n", mountinfo) == (1, tmp_path / "memory" / "job" / "7")
    (tmp_path / "unified" / "user.slice" / "cgroup.controllers").write_text("cpu io memory\n")
    assert locate("4:memory:/job/7\n0::/user.slice\n", mountinfo) == (2, tmp_path / "unified" / "user.slice")
    why = locate("0::/elsewhere\n", mountinfo)
    assert isinstance(why, str) and why
    # a namespaced mount whose root is the group itself
    nested = f"33 25 0:28 /job/7 {tmp_path}/memory/job/7 rw - cgroup cgroup rw,memory\n"
    assert locate("4:memory:/job/7/sub\n", nested) == "cgroup v1's memory hierarchy is not mounted where this " \
                                                      "process can see its group"
    (tmp_path / "memory" / "job" / "7" / "sub").mkdir()
    assert locate("4:memory:/job/7/sub\n", nested) == (1, tmp_path / "memory" / "job" / "7" / "sub")


def test_memory_sizes_are_parsed_strictly():
    assert parse_memory_size("2G") == 2 * 2**30
    assert parse_memory_size("768MiB") == 768 * 2**20
    assert parse_memory_size(str(MIN_CEILING)) == MIN_CEILING
    assert parse_memory_size("off") is None and parse_memory_size("0") is None
    for bad in ("", "2 gigs", "-1G", "1.5G", "12P", "64M"):
        with pytest.raises(ValueError):
            parse_memory_size(bad)


@given(st.integers(MIN_CEILING, 2**44), st.sampled_from(["", "b", "K", "kib", "M", "mb", "G", "GiB"]))
def test_memory_sizes_round_trip(number, unit):
    scale = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit[:1].lower()]
    value = number // scale or 1
    size = value * scale
    if size < MIN_CEILING:
        with pytest.raises(ValueError):
            parse_memory_size(f"{value}{unit}")
    else:
        assert parse_memory_size(f"{value}{unit}") == size


def test_the_browser_group_is_entered_before_the_driver_runs(tmp_path):
    group = BrowserCgroup(tmp_path, 1)
    (tmp_path / "cgroup.procs").write_text("")
    argv = group.enter_command(["/bin/echo", "hello"])
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    assert done.stdout == "hello\n"
    assert (tmp_path / "cgroup.procs").read_text().strip().isdigit()  # the shell wrote its pid, then exec'd
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert group.oom_kills() == 3
    assert BrowserCgroup(tmp_path, 2).oom_kills() == 0  # v2 reads memory.events, absent here


def test_a_directory_that_is_no_memory_cgroup_is_refused(tmp_path):
    with pytest.raises(CgroupError, match="not a memory cgroup"):
        MemoryCeiling.prepare(MIN_CEILING, tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a memory cgroup needs root (or a delegated group)")
def test_a_real_group_is_made_with_its_limit_and_removed():
    try:
        ceiling = MemoryCeiling.prepare(256 * 2**20)
    except CgroupError as err:
        pytest.skip(f"this machine offers no writable memory cgroup: {err}")
    group = ceiling.group()
    try:
        limit_file = "memory.max" if group.version == 2 else "memory.limit_in_bytes"
        assert int((group.path / limit_file).read_text()) == 256 * 2**20
        assert group.pids() == [] and group.oom_kills() == 0
    finally:
        group.remove()
    assert not group.path.exists()


def test_clients_are_keyed_by_address():
    class Peer:
        def __init__(self, address):
            self.remote_address = address

    assert client_key(Peer(("127.0.0.5", 40000))) == "127.0.0.5"
    assert client_key(Peer(("::ffff:127.0.0.5", 40000, 0, 0))) == "127.0.0.5"
    assert client_key(Peer(("::1", 1, 0, 0))) == "::1"
    assert client_key(Peer(None)) == "unknown"


# ---- options -------------------------------------------------------------------------------------


def test_server_limits_have_safe_defaults_and_refuse_nonsense():
    limits = ServerLimits()
    assert limits.max_contexts_per_client <= limits.max_contexts and limits.browser_memory_max
    assert limits.max_message_bytes == 32 * 2**20
    for bad in ({"max_contexts": 0}, {"max_connections_per_client": 0}, {"context_idle": 0},
                {"connection_idle": -1}, {"context_idle": float("nan")}, {"max_message_bytes": 1000},
                {"max_calls_in_flight": 0}):
        with pytest.raises(ValueError, match="^--"):
            ServerLimits(**bad)
    assert ServerLimits(max_contexts=1).max_contexts_per_client == 2  # the global cap then decides
    parsed = ServerLimits.from_options({"max_contexts": 4, "browser_memory_max": None, "port": 3000,
                                        "browser_cgroup_parent": Path("/x")})
    assert parsed.max_contexts == 4 and parsed.browser_memory_max is None
    assert parsed.browser_cgroup_parent == Path("/x") and parsed.max_contexts_per_client == 2
