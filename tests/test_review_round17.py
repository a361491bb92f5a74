"""Review round 17: what the two transports still did differently, and what the helpers' reviews found."""

from __future__ import annotations

import pytest
from audit_watch import AuditWatch
from test_review_round9 import SCRIPTS, Close, first_then_next, origins, responses, status_lines  # noqa: F401
from test_review_round9 import proxy as scripted_proxy  # noqa: F401 (a module-scoped fixture: both transports)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("internal_saw_nothing")]

SCRIPTS.update({  # read by test_review_round9's module-scoped origins fixture, one origin each
    "version-1.2": [b"HTTP/1.2 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-0.9": [b"HTTP/0.9 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-1.0": [b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"],
    "version-1.0-until-close": [b"HTTP/1.0 200 OK\r\n\r\nhello", 0.2, Close()],
})


@pytest.mark.parametrize("case", ["version-1.2", "version-0.9", "version-1.0", "version-1.0-until-close"])
def test_the_status_line_carries_the_proxys_own_http_version(scripted_proxy, origins, case):  # noqa: F811
    """mitmproxy's path wrote ``HTTP/1.2 200`` and ``HTTP/0.9 200`` to the client as the origin sent them, where
    the fast path answers in its own version, HTTP/1.1 (RFC 9110 6.2: an intermediary sends its own version in
    what it forwards). Both send HTTP/1.1 now, and the body arrives whole."""
    audit = AuditWatch(scripted_proxy.log_path).mark()
    raw = first_then_next(scripted_proxy, origins[case].port)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n"), raw
    head, _, body = raw.partition(b"\r\n\r\n")
    # a body read until the origin closed is re-framed by the fast path (chunked) and kept alive
    assert body.startswith((b"hello", b"5\r\nhello\r\n0\r\n\r\n")), raw
    assert b"HTTP/1.2" not in raw and b"HTTP/0.9" not in raw, raw
    for line in status_lines(raw):
        assert line.startswith(b"HTTP/1.1 200"), raw
    (record,) = responses(scripted_proxy, audit, 1)[:1]
    assert record["status"] == 200 and record["bytes_down"] == 5, record
