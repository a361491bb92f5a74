"""The ``upstream`` block of the policy, its URL and its credentials file (pure code and the file reader)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from policy.loader import Overrides, PolicyError, parse_policy
from policy.upstream import parse_upstream_proxy
from proxy.upstream import UpstreamError, basic_authorization, parse_credentials, read_credentials

BASE = "version: 1\n"


def upstream_block(*lines: str) -> str:
    return BASE + "upstream:\n" + "".join(f"  {line}\n" for line in lines)


def load(text: str, overrides: Overrides | None = None):
    return parse_policy(text, "p.yaml", overrides)


def problems(text: str, overrides: Overrides | None = None) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load(text, overrides)
    return [str(p) for p in caught.value.problems]


def test_a_complete_block_is_the_model() -> None:
    policy = load(upstream_block("proxy: http://Proxy.Corp.Example:3128", "resolution: upstream",
                                 "credentials_file: /etc/egresswall/upstream"))
    up = policy.upstream
    assert (up.host, up.port, up.resolution, up.credentials_file) == ("proxy.corp.example", 3128, "upstream",
                                                                      "/etc/egresswall/upstream")
    assert up.url == "http://proxy.corp.example:3128" and (up.origin.line, up.origin.path) == (3, "upstream")


def test_no_block_no_upstream() -> None:
    assert load(BASE).upstream is None


@pytest.mark.parametrize("url, host, port", [
    ("http://127.0.0.1:3128", "127.0.0.1", 3128), ("http://[::1]:3128", "::1", 3128),
    ("http://[2001:DB8::1]:8080/", "2001:db8::1", 8080), ("HTTP://squid:3128", "squid", 3128),
    ("http://proxy.example.:80", "proxy.example", 80)])
def test_accepted_urls(url: str, host: str, port: int) -> None:
    assert parse_upstream_proxy(url) == (host, port)


@pytest.mark.parametrize("url, words", [
    ("127.0.0.1:3128", "the scheme is required"),
    ("https://proxy.example:3128", "https:// upstream (TLS to the proxy itself) is not supported"),
    ("socks5://proxy.example:1080", "only an HTTP proxy can be an upstream"),
    ("http://proxy.example", "explicit port"),
    ("http://proxy.example:0", "port must be 1-65535"),
    ("http://proxy.example:65536", "port must be 1-65535"),
    ("http://proxy.example:3128/path", "no path, query or fragment"),
    ("http://proxy.example:3128?x=1", "no path, query or fragment"),
    ("http://proxy.example:3128#top", "no path, query or fragment"),
    ("http://:3128", "the proxy host is empty"),
    ("http://127.1:3128", "neither an IP address nor a host name"),
    ("http://pro_xy.example:3128", "neither an IP address nor a host name"),
    ("http://-proxy.example:3128", "neither an IP address nor a host name"),
    ("http://::1:3128", "needs brackets"),
    ("http://proxy example:3128", "space or a control character"),
])
def test_refused_urls_say_why(url: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_upstream_proxy(url)
    assert words in str(caught.value)


@pytest.mark.parametrize("url", ["http://user:hunter2@proxy.example:3128", "http://hunter2@proxy.example:3128",
                                 "user:hunter2@proxy.example:3128", "http://user:hun/ter2@proxy.example:3128",
                                 "https://user:hunter2@proxy.example:3128"])
def test_credentials_in_the_url_are_refused_and_never_repeated(url: str) -> None:
    found = problems(upstream_block(f"proxy: '{url}'", "resolution: upstream"))
    assert len(found) == 1 and "credentials in the proxy URL are never accepted" in found[0]
    assert found[0].startswith("p.yaml:3:10: upstream.proxy: ")
    assert "hunter2" not in found[0] and "***@proxy.example:3128" in found[0]


@given(st.text(min_size=1, max_size=20).filter(lambda s: "@" not in s), st.text(max_size=40))
def test_nothing_before_an_at_sign_is_ever_repeated(secret: str, rest: str) -> None:
    url = f"http://u:{secret}@{rest}"
    with pytest.raises(ValueError) as caught:
        parse_upstream_proxy(url)
    shown = str(caught.value)
    assert f"u:{secret}" not in shown and "credentials in the proxy URL" in shown


@given(st.text(max_size=60))
def test_any_text_is_parsed_or_refused_with_a_reason(text: str) -> None:
    try:
        host, port = parse_upstream_proxy(text)
    except ValueError as err:
        assert str(err)
    else:  # what is accepted is exactly an http://HOST:PORT[/] the parser can read back
        assert 1 <= port <= 65535 and host and "@" not in text
        assert text.lower().startswith("http://")
        again = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        assert parse_upstream_proxy(again) == (host, port)


def test_without_resolution_it_does_not_load_in_one_line() -> None:
    found = problems(upstream_block("proxy: http://127.0.0.1:3128"))
    assert len(found) == 1
    assert found[0].startswith("p.yaml:3:3: upstream: an upstream proxy resolves names itself, so egresswall cannot "
                               "pin the address it checked; set upstream.resolution: upstream")


def test_resolution_has_one_value_and_proxy_is_required() -> None:
    assert "got 'egresswall'; expected one of: upstream" in problems(
        upstream_block("proxy: http://127.0.0.1:3128", "resolution: egresswall"))[0]
    assert "upstream: missing key; expected 'proxy'" in problems(upstream_block("resolution: upstream"))[0]
    assert "unknown key 'password'" in problems(
        upstream_block("proxy: http://127.0.0.1:3128", "resolution: upstream", "password: x"))[0]


def test_the_credentials_path_must_be_absolute() -> None:
    found = problems(upstream_block("proxy: http://127.0.0.1:3128", "resolution: upstream",
                                    "credentials_file: secrets/upstream"))
    assert found == ["p.yaml:5:21: upstream.credentials_file: got 'secrets/upstream'; expected an absolute path "
                     "(a relative one would depend on the directory egresswall was started in)"]


def test_flags_replace_proxy_and_credentials_but_not_the_acknowledgement() -> None:
    policy = load(upstream_block("proxy: http://127.0.0.1:1", "resolution: upstream"),
                  Overrides(upstream="http://127.0.0.1:3128", upstream_credentials_file="/run/creds"))
    assert (policy.upstream.port, policy.upstream.credentials_file) == (3128, "/run/creds")
    found = problems(BASE, Overrides(upstream="http://127.0.0.1:3128"))
    assert len(found) == 1 and "(given by command line --upstream)" in found[0]
    bad = problems(upstream_block("resolution: upstream"), Overrides(upstream="ftp://127.0.0.1:21"))
    assert bad == ["command line --upstream: upstream.proxy: got 'ftp://127.0.0.1:21'; only an HTTP proxy can be an "
                   "upstream: expected http://HOST:PORT"]


# ---- the credentials file ---------------------------------------------------------------------------


def test_credentials_lines() -> None:
    assert parse_credentials(b"user:pa:ss\n") == "user:pa:ss"  # the password may hold ':'
    assert parse_credentials(b"user:p\r\n") == "user:p"
    assert basic_authorization("Aladdin:open sesame") == "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="  # RFC 7617


@pytest.mark.parametrize("raw, words", [
    (b"", "expected one line user:password"), (b"user\n", "expected one line user:password"),
    (b":pw\n", "expected one line user:password"), (b"user:\n", "expected one line user:password"),
    (b"user:pw\nuser2:pw\n", "more than one line"), (b"user:p\x00w", "control character"),
    (b"user:\xff\xfe", "not UTF-8"), (b"u:" + b"x" * 5000, "over 4096 bytes")])
def test_bad_credentials_say_why_without_the_password(raw: bytes, words: str) -> None:
    with pytest.raises(UpstreamError) as caught:
        parse_credentials(raw, "upstream.credentials_file /f")
    assert words in str(caught.value) and b"pw" not in str(caught.value).encode()


def upstream_with(path: Path):
    return load(upstream_block("proxy: http://127.0.0.1:3128", "resolution: upstream",
                               f"credentials_file: {path}")).upstream


def test_reading_the_file(tmp_path: Path) -> None:
    path = tmp_path / "creds"
    path.write_text("egress:s3cret\n")
    path.chmod(0o640)  # group-readable is allowed
    assert read_credentials(upstream_with(path)) == "egress:s3cret"
    assert read_credentials(load(upstream_block("proxy: http://127.0.0.1:3128", "resolution: upstream")).upstream) \
        is None


def test_a_missing_file_a_directory_and_a_world_readable_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match="no such file or directory"):
        read_credentials(upstream_with(tmp_path / "missing"))
    with pytest.raises(UpstreamError, match="not a regular file"):
        read_credentials(upstream_with(tmp_path))
    real = tmp_path / "real"
    real.write_text("u:p\n")
    real.chmod(0o600)
    link = tmp_path / "link"  # a mounted Kubernetes secret is a symbolic link: its target is judged
    os.symlink(real, link)
    assert read_credentials(upstream_with(link)) == "u:p"
    real.chmod(0o604)
    for path in (real, link):
        with pytest.raises(UpstreamError, match=r"readable by every user \(mode 0604\).*chmod o-r"):
            read_credentials(upstream_with(path))


def test_lint_notes_the_weakened_guarantee_and_strict_still_passes(tmp_path: Path) -> None:
    import subprocess
    import sys

    policy = tmp_path / "p.yaml"
    policy.write_text(upstream_block("proxy: http://127.0.0.1:3128", "resolution: upstream"))
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "lint", "--strict", str(policy)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"note: {policy}:3:3: upstream: every allowed request and tunnel goes through the "
                                  "upstream proxy http://127.0.0.1:3128, which resolves names itself: the address "
                                  "guarantee is weakened")


@given(st.binary(max_size=64))
@example(b"user:pw\r")
@example(b"user:pw\r\n")
def test_any_credentials_file_is_one_accepted_line_or_refused_without_its_content(raw: bytes) -> None:
    try:
        line = parse_credentials(raw, "F")
    except UpstreamError as err:
        shown = str(err)
        assert shown.startswith("F: ")
        secret = raw.partition(b":")[2].strip()
        if len(secret) >= 4:  # a password is never repeated (short fragments may occur in the words by chance)
            assert secret.decode("utf-8", "replace") not in shown[3:]
    else:
        user, _, password = line.partition(":")
        assert user and password and "\n" not in line and "\r" not in line
        assert raw in (line.encode(), line.encode() + b"\n", line.encode() + b"\r\n")
