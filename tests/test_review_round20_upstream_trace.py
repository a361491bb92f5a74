"""Review round 20 (a helper's: upstream proxy): a TRACE with Max-Forwards through squid never shows the client
egresswall's upstream
credentials (held: egresswall forwards TRACE and Max-Forwards as they are, and squid answers a TRACE at
Max-Forwards: 0 itself, echoing the request with "Proxy-Authorization: ** NOT DISPLAYED **")."""
from __future__ import annotations

import base64

import pytest
from proxyproc import TRANSPORTS
from test_upstream_proxy import (  # noqa: F401
    PASSWORD,
    USER,
    access_log,
    credentials_file,
    squid,
    upstream_policy,
)

pytestmark = pytest.mark.integration

SECRET_B64 = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


@pytest.mark.parametrize("transport", list(TRANSPORTS), indirect=True)
@pytest.mark.parametrize("max_forwards", ["0", "1"])
def test_trace_through_upstream_never_echoes_its_credentials(lab, squid, start_proxy, tmp_path, transport,  # noqa: F811
                                                            max_forwards) -> None:
    proxy = start_proxy(upstream_policy(lab, squid, credentials_file(tmp_path)))
    url = f"http://public.lab.example:{lab.public.port}/trace"
    answer = proxy.raw((f"TRACE {url} HTTP/1.1\r\nHost: public.lab.example:{lab.public.port}\r\n"
                        f"Max-Forwards: {max_forwards}\r\nConnection: close\r\n\r\n").encode())
    assert SECRET_B64.encode() not in answer and PASSWORD.encode() not in answer

