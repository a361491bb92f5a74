"""The proxy's event loop (proxy/event_loop.py): uvloop's by default, the standard library's with
``--no-uvloop``. Both enforce the same, and the test guard inside the proxy process (tests/proxyproc.py)
watches both: a guard that saw nothing would make every "no connect left loopback" check pass vacuously."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from labnet import PUBLIC_IP, Upstream
from proxyproc import GUARD_PRELUDE, ROOT

from proxy import event_loop


@pytest.fixture
def origin():
    """An origin of this test's own on the lab's public address, so the test can say exactly what reached it
    (the shared origin's history holds every earlier test's requests)."""
    server = Upstream(PUBLIC_IP, "loop")
    yield server
    server.close()


LOOPS = {"uvloop": ((), "_GuardedLoop"), "standard": (("--no-uvloop",), "_UnixSelectorEventLoop")}


@pytest.mark.parametrize("name", list(LOOPS))
def test_the_proxy_runs_on_the_chosen_loop_and_enforces_the_same(lab, start_proxy, origin, name):
    options, loop_class = LOOPS[name]
    text = lab.policy_text("hosts:\n  deny: [denied.lab.example]\n").replace("  http: [", f"  http: [{origin.port}, ")
    proxy = start_proxy(text, *options)
    sock, status, _ = proxy.connect(f"public.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 200
    status, headers, body = proxy.get(f"http://public.lab.example:{origin.port}/")
    assert status == 200, (headers, body, proxy.audit(), proxy.guard_events())
    assert [path for _, path, _ in origin.requests] == ["/"]
    status, headers, _ = proxy.get(f"http://internal.lab.example:{lab.public.port}/")
    assert status == 403 and headers["x-egresswall-rule"].startswith("special-purpose")
    sock, status, _ = proxy.connect(f"denied.lab.example:{lab.public_tls.port}")
    sock.close()
    assert status == 403
    connects = proxy.outbound()
    assert connects and {c["host"] for c in connects} == {PUBLIC_IP}
    assert {c["loop"] for c in connects} == {loop_class}  # the guard saw them on the loop asked for
    assert proxy.getaddrinfo_names() == []  # names are resolved by the policy's resolver, never the system's
    # ... whose queries the guard sees too, on either loop: to the lab's DNS server and nowhere else.
    queries = {(d["host"], d["port"]) for d in proxy.datagrams()}
    assert queries == {(lab.dns.host, lab.dns.port)}, queries


GUARD_SELF_TEST = """
import asyncio, socket, sys
from proxy import event_loop
listener = socket.create_server(("127.0.0.1", 0))
port = listener.getsockname()[1]
async def main():
    loop = asyncio.get_running_loop()
    sock = socket.socket(); sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port)); sock.close()
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port); transport.close()
    await loop.getaddrinfo("localhost", port)
    plain = socket.socket(); plain.setblocking(False); plain.connect_ex(("127.0.0.1", port)); plain.close()
    async def socket_connect():
        socket.socket().connect_ex(("localhost", port))
    for connect in (lambda: loop.create_connection(asyncio.Protocol, "localhost", port),
                    lambda: loop.sock_connect(socket.socket(), ("localhost", port)), socket_connect):
        try:
            await connect()
        except OSError as err:
            print("refused:", err)
event_loop.run(main(), use_uvloop=sys.argv[1] == "uvloop")
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.sendto(b"to loopback", ("127.0.0.1", port))
try:
    udp.sendto(b"to a name", ("localhost", port))
except OSError as err:
    print("refused:", err)
udp.close()
"""


@pytest.mark.parametrize("name", list(LOOPS))
def test_the_guard_sees_and_refuses_on_either_loop(tmp_path, name):
    """Outside loopback the guard refuses before a packet: a name ("localhost") is refused unresolved."""
    guard = tmp_path / "guard.jsonl"
    prelude = GUARD_PRELUDE.replace("GUARD_PATH", repr(str(guard)))
    run = subprocess.run([sys.executable, "-c", prelude + GUARD_SELF_TEST, name], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("refused: test guard: refusing a connect") == 3, run.stdout
    assert run.stdout.count("refused: test guard: refusing a datagram") == 1, run.stdout
    events = [json.loads(line) for line in guard.read_text().splitlines()]
    kinds = [(e["kind"], e["host"]) for e in events]
    assert kinds.count(("connect", "127.0.0.1")) >= 3 and ("getaddrinfo", "localhost") in kinds
    assert ("datagram", "127.0.0.1") in kinds and ("datagram", "localhost") in kinds
    assert {e["loop"] for e in events if e["kind"] == "connect"} <= {LOOPS[name][1], None}


def test_uvloop_is_the_default_and_the_standard_loop_is_a_choice() -> None:
    import asyncio

    import uvloop

    assert event_loop.loop_factory() is uvloop.new_event_loop
    assert event_loop.loop_factory(False) is asyncio.new_event_loop
    assert event_loop.run(_loop_type(), use_uvloop=False) is asyncio.get_event_loop_policy().new_event_loop().__class__


async def _loop_type() -> type:
    import asyncio

    return type(asyncio.get_running_loop())


@pytest.mark.parametrize("name", list(LOOPS))
def test_the_loop_takes_asyncio_s_eager_task_factory(name) -> None:
    """mitmproxy's master runs with ``asyncio.eager_task_factory`` set on the loop. uvloop 0.23 on Python
    3.13 passes that factory an ``eager_start`` it does not take, and the proxy died at start (the image's
    Python is 3.13): every way a task is made must work on the loop the proxy runs on."""
    import asyncio

    async def child() -> int:
        return 1

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(asyncio.eager_task_factory)
        results = [await loop.create_task(child()), await asyncio.ensure_future(child())]
        async with asyncio.TaskGroup() as group:
            task = group.create_task(child())
        return [*results, task.result()]

    assert event_loop.run(main(), use_uvloop=name == "uvloop") == [1, 1, 1]
