"""Review round 18: the messages a newcomer met that said something untrue or nothing at all.

- A URL grant with another scheme was refused with the URL parser's own list, "not one of http, https, ws,
  wss", and a wss grant was then refused too: the error names what a grant takes.
- An address without dots or colons was refused as "a legacy IPv4 form" whatever it was (``localhost``).
- ``replay --at`` took a duration it did not document (read as back from now) and its error never named
  ``now``, which it takes; ``--examples -1`` was accepted and quietly read as 0.
- ``--confdir`` that cannot be used said so without saying what to give instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policy.addresses import parse_address
from policy.sessions import parse_url_grant

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("url", ["ftp://a.example/x", "wss://a.example/x", "WS://a.example/x", "gopher://a.example/"])
def test_a_url_grant_of_another_scheme_names_what_a_grant_takes(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_url_grant(url)
    message = str(caught.value)
    assert "a URL grant is an http or https URL" in message and "ws, wss" not in message, message


@pytest.mark.parametrize("url, words", [(" http://a.example/x", "no scheme"), ("http ://a.example/x", "no scheme"),
                                        ("http\n://a.example/x", "control character")])
def test_a_malformed_scheme_keeps_the_url_parser_s_own_words(url: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_url_grant(url)
    assert words in str(caught.value) and "a URL grant is an http or https URL" not in str(caught.value)


@pytest.mark.parametrize("url", ["http://a.example/x", "HTTPS://a.example/x"])
def test_http_and_https_grants_still_parse(url: str) -> None:
    assert parse_url_grant(url).scheme == url.partition(":")[0].lower()


@pytest.mark.parametrize("text, legacy", [
    ("3232235777", True), ("0xc0a80101", True), ("0XC0A80101", True),
    ("localhost", False), ("abc", False), ("١٢٣", False),  # Arabic-Indic digits: not a number inet_aton reads
    ("0xyz", False),
])
def test_only_a_bare_number_is_called_a_legacy_ipv4_form(text: str, legacy: bool) -> None:
    with pytest.raises(ValueError) as caught:
        parse_address(text)
    assert ("legacy IPv4 form" in str(caught.value)) is legacy, caught.value


def _replay(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    log = tmp_path / "audit.jsonl"
    log.write_text("")
    return subprocess.run([sys.executable, "-m", "proxy.cli", "replay", str(log), "--policy",
                           str(ROOT / "policy/default.yaml"), *options],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("value", ["2h", "7d", "bogus"])
def test_replay_at_takes_a_moment_or_now_and_says_so(tmp_path: Path, value: str) -> None:
    result = _replay(tmp_path, "--at", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--at {value!r}: expected an RFC 3339 time" in result.stderr and "or now" in result.stderr, result.stderr
    assert "duration" not in result.stderr


@pytest.mark.parametrize("value", ["now", "2026-12-01", "2026-12-01T07:00:00Z"])
def test_replay_at_accepts_a_moment_and_now(tmp_path: Path, value: str) -> None:
    result = _replay(tmp_path, "--at", value)
    # An empty log: nothing is an audit record (exit 2), but no complaint about --at.
    assert "--at" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["-1", "1e3", "", "３"])
def test_replay_examples_must_be_a_whole_number(tmp_path: Path, value: str) -> None:
    result = _replay(tmp_path, "--examples", value)
    assert result.returncode == 2 and "argument --examples" in result.stderr, result.stderr
    assert "expected a whole number" in result.stderr


def test_an_unusable_confdir_says_what_to_give(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "--confdir", "/proc/egresswall-ca",
                             "--listen", "127.0.0.1:0", "--no-admin"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "give a directory this user can create and write" in result.stderr, result.stderr
