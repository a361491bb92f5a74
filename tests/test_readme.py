"""The README says what the code does: defaults, which commands take which options, the layout, and the
example outputs (regenerated here by running the commands and compared byte for byte)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policy.loader import parse_policy
from proxy.policy_file import load_policy_file

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FLAT = " ".join(README.split())  # wrapping-insensitive


def test_the_port_defaults_the_readme_states_are_the_loader_s() -> None:
    bare = parse_policy("version: 1\n", "p.yaml")
    assert bare.connect_ports == {443} and bare.http_ports == {80}
    bundled = load_policy_file(ROOT / "policy" / "default.yaml")
    assert bundled.connect_ports == {443, 80}
    assert ("CONNECT only to `ports.connect` (default `[443]`; the bundled `policy/default.yaml` lists `[443, 80]`), "
            "plain HTTP only to `ports.http` (default `[80]`)") in FLAT
    assert not re.search(r"ports\.connect` \(default 443 and 80\)", FLAT)


# ---- which commands take the policy options -------------------------------------------------------------------

POLICY_OPTIONS = ["--default", "--mode", "--allow-host", "--deny-host", "--allow-range", "--deny-range",
                  "--nameserver", "--upstream", "--upstream-credentials-file"]


def _commands() -> dict[str, set[str]]:
    """Each (sub)command's option strings, from the parser `egresswall COMMAND --help` prints."""
    import argparse

    from proxy.cli import build_parser

    def subcommands(parser: argparse.ArgumentParser, prefix: str) -> dict[str, set[str]]:
        out = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    nested = subcommands(child, f"{prefix}{name} ")
                    out.update(nested or {f"{prefix}{name}": {o for a in child._actions for o in a.option_strings}})
        return out

    return subcommands(build_parser([]), "")


def test_the_policy_options_are_on_exactly_the_commands_the_readme_names() -> None:
    commands = _commands()
    assert set(commands) == {"check", "lint", "run", "browse", "browser-server", "squid import", "squid export",
                             "replay", "suggest"}
    with_all = {name for name, options in commands.items() if set(POLICY_OPTIONS) <= options}
    with_any = {name for name, options in commands.items() if set(POLICY_OPTIONS) & options}
    assert with_all == with_any == {"run", "check", "browse", "browser-server"}
    assert ("`run`, `check`, `browse` and `browser-server` (and only these) take the policy options" in FLAT)
    said = FLAT[FLAT.index("The policy options: `--policy FILE`"):FLAT.index("| command | what it does |")]
    assert [o for o in POLICY_OPTIONS if f"`{o} " not in said and f"`{o}`" not in said] == []
    assert not re.search(r"Every command that takes a policy takes these", FLAT)


def test_lint_strict_exits_1_on_warnings_as_the_readme_says(tmp_path: Path, capsys) -> None:
    from proxy.cli import main

    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nhosts:\n  allow:\n    - .example.org\n    - a.example.org\n")  # a shadowed rule
    assert main(["lint", str(path)]) == 0
    assert main(["lint", str(path), "--strict"]) == 1
    out = capsys.readouterr().out
    assert f"warning: {path}:5:7: hosts.allow[1]: a.example.org is shadowed" in out
    path.write_text("version: 1\n")
    assert main(["lint", str(path), "--strict"]) == 0
    assert ("Exit 0 when the policy loads, warnings or not; with `--strict`, exit 1 when there is any warning "
            "(a `note:` line, such as the upstream one, is no warning); 2 when it does not load") in FLAT


# ---- the session API's curl examples, run with curl against a real admin listener --------------------------------

def _shell_block(after: str) -> list[tuple[str, list[str]]]:
    """(command, output lines) of the first ``` block after ``after``; continuation lines joined."""
    start = README.index("```\n", README.index(after)) + 4
    lines = README[start:README.index("```", start)].splitlines()
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and out[-1][0].endswith("\\") and not out[-1][1]:
            out[-1] = (out[-1][0][:-1] + line.strip(), [])
        else:
            out[-1][1].append(line)
    return out


def _same_json(said: str, got: str, session_id: str) -> None:
    import json

    said_value, got_value = json.loads(said.replace("se1136ee39d86e6c1ac7a38c3", session_id)), json.loads(got)

    def compare(a, b, where: str) -> None:
        if isinstance(a, str) and "..." in a:
            assert isinstance(b, str) and b.startswith(a.split("...")[0]), (where, a, b)
        elif isinstance(a, dict):
            assert isinstance(b, dict) and list(a) == list(b), (where, a, b)
            for key in a:
                compare(a[key], b[key], f"{where}.{key}")
        else:
            assert a == b, (where, a, b)

    compare(said_value, got_value, "")


@pytest.mark.integration
def test_the_session_api_curl_examples_answer_what_the_readme_shows(tmp_path: Path) -> None:
    from proxyproc import ProxyProcess
    from session_client import TOKEN, token_file

    proxy = ProxyProcess(["--admin-token-file", str(token_file(tmp_path)), "--nameserver", "127.0.0.1:9"],
                         tmp_path / "audit.jsonl")
    try:
        steps = _shell_block("A call with a body (`POST /v1/sessions`, `extend`, `PATCH`) must send")
        assert steps[0][0] == "TOKEN=$(cat /etc/egresswall/admin-token)"
        session_id = None
        for command, said in steps[1:]:
            command = command.replace("127.0.0.1:3131", f"127.0.0.1:{proxy.admin_port}")
            if session_id:
                command = command.replace("se1136ee39d86e6c1ac7a38c3", session_id)
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30,
                                  env={**os.environ, "TOKEN": TOKEN})
            assert done.returncode == 0, done.stderr
            (line,) = said
            if line.startswith("{\"id\""):
                session_id = session_id or json.loads(done.stdout)["id"]
                _same_json(line, done.stdout, session_id)
            else:
                assert done.stdout in (line, line + "\n"), command  # byte for byte (JSON bodies end without a newline)
        assert session_id is not None
    finally:
        proxy.stop()
    assert proxy.outbound() == []


@pytest.mark.integration
@pytest.mark.parametrize(("after", "policy"), [
    ("A refused request gets `403`", None),  # the bundled policy
    ("For example, with `egresswall run --policy policy.yaml`", "version: 1\nmode: enforce\ndefault: deny\n"),
])
def test_the_refusal_examples_are_what_the_proxy_answers(tmp_path: Path, after: str, policy: str | None) -> None:
    """README's first refusals, run against the policy README names: each line as README shows it, where ``...``
    stands for text README leaves out. Both targets are refused before any lookup (an address literal, a
    name off the allowlist) and the nameserver is a closed loopback port, so nothing leaves the machine."""
    from proxyproc import ProxyProcess

    args = ["--nameserver", "127.0.0.1:9"]
    if policy is not None:
        (tmp_path / "policy.yaml").write_text(policy)
        args += ["--policy", str(tmp_path / "policy.yaml")]
    proxy = ProxyProcess(args, tmp_path / "audit.jsonl")
    try:
        ((command, said),) = _shell_block(after)
        command = command.replace("127.0.0.1:3128", f"127.0.0.1:{proxy.port}")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        got = done.stdout.replace(f"{tmp_path}/", "").splitlines()  # README runs it where policy.yaml is
        assert len(got) == len(said), (said, got)
        for line, shown in zip(got, said, strict=True):
            pattern = ".*".join(re.escape(part) for part in shown.split("..."))
            assert re.fullmatch(pattern, line), (shown, line)
    finally:
        proxy.stop()
    assert proxy.outbound() == []


# ---- the layout table ---------------------------------------------------------------------------------------------

def _layout_rows() -> dict[str, str]:
    table = README[README.index("## Layout"):README.index("## Errors you may see")]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `([a-z-]+)/` \| (.*) \|$", line)
        if match:
            rows[match[1]] = match[2]
    return rows


def test_the_layout_table_names_files_that_exist_and_every_module_of_policy_and_proxy() -> None:
    rows = _layout_rows()
    assert set(rows) == {"policy", "proxy", "browser", "squid-compat", "compose", "ci", "tests"}
    missing = []
    for folder, text in rows.items():
        for name in re.findall(r"`([\w./-]+\.(?:py|json|yaml|sh)|[\w-]+/)`", text):
            name = name.removeprefix(f"{folder}/")
            found = (ROOT / folder / name).exists() or any((ROOT / folder).rglob(name.rstrip("/")))
            if not found and not (ROOT / name).exists():
                missing.append(f"{folder}: {name}")
    assert missing == []
    for folder in ("policy", "proxy"):
        modules = {p.name for p in (ROOT / folder).iterdir()
                   if p.name != "__init__.py" and not p.name.startswith((".", "__"))
                   and (p.suffix in (".py", ".json", ".yaml") or (p.is_dir() and p.name != "cli"))}
        named = set(re.findall(r"`([\w.-]+?)/?`", rows[folder]))
        assert sorted(m for m in modules if m not in named) == [], folder
    assert "`proxy/cli/`" in rows["proxy"]


# ---- the replay and suggest examples, regenerated by running the commands -----------------------------------------

def _egresswall(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], capture_output=True, text=True, cwd=folder,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _readme_block(command: str) -> str:
    """The ``` block whose first line starts ``$ COMMAND``, without its fences."""
    start = README.index(f"```\n$ {command}") + 4
    return README[start:README.index("```", start)]


def replay_transcript(folder: Path) -> str:
    """The README's replay example: tests/test_replay.py's log of test decisions, replayed against an edit
    that removes docs.example.com, adds new.example.com and narrows api.example.net to port 443."""
    import test_replay
    from audit_factory import write_log

    write_log(folder / "audit.jsonl", test_replay.enforce_log())
    (folder / "new.yaml").write_text(test_replay.policy_text(extra=test_replay.ADD_HOST["extra"],
                                                             drop="docs.example.com", api_ports="[443]"))
    command = "replay audit.jsonl --policy new.yaml --fail-on refuse --examples 1"
    done = _egresswall(folder, *command.split())
    assert done.stderr == ""
    return f"$ egresswall {command}\n{done.stdout}$ echo $?\n{done.returncode}\n"


def suggest_transcript(folder: Path) -> str:
    """The README's suggest example: tests/test_suggest.py's report-mode log of a page load."""
    import test_suggest
    from audit_factory import write_log

    write_log(folder / "report.jsonl", test_suggest.page_load_records(test_suggest.lab_policy()))
    (folder / "lab.yaml").write_text(test_suggest.LAB.format(mode="report", extra=""))
    command = "suggest report.jsonl --policy lab.yaml -o suggested.yaml"
    done = _egresswall(folder, *command.split())
    assert done.returncode == 0 and done.stdout == ""
    lint = _egresswall(folder, "lint", "suggested.yaml", "--strict")
    assert lint.returncode == 0 and lint.stderr == ""
    return (f"$ egresswall {command}\n{done.stderr}$ cat suggested.yaml\n{(folder / 'suggested.yaml').read_text()}"
            f"$ egresswall lint suggested.yaml --strict\n{lint.stdout}")


def test_the_readme_s_replay_example_is_what_replay_prints(tmp_path: Path) -> None:
    assert _readme_block("egresswall replay audit.jsonl") == replay_transcript(tmp_path)


def test_the_readme_s_suggest_example_is_what_suggest_prints(tmp_path: Path) -> None:
    from proxy.suggest import expiry_date

    said = _readme_block("egresswall suggest report.jsonl")
    shown = re.findall(r'expires: "(\d{4}-\d\d-\d\d)"', said)
    assert len(shown) == 5 and len(set(shown)) == 1  # the default expiry, 90 days from the day it was run
    assert said.replace(shown[0], expiry_date("90d")) == suggest_transcript(tmp_path)
