"""What ``egresswall run`` loads (issue 15 item 3): the proxy and its workers import neither the browser, nor
Playwright's helpers, nor the squid translator, nor mitmproxy's thirty-odd addons it never instantiates, nor
aiohttp's client; the Master still has every addon enforcement relies on. Through a real ProxyRunner on
loopback ports, in a fresh interpreter, so that nothing this test process imported counts. The figures are
tests/benchmarks/bench_memory.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration

# Started as `egresswall run` and its workers start: the command line parsed, the worker module imported,
# a ProxyRunner serving until ready; then what is in sys.modules and which addons the Master holds.
PROBE = """
import asyncio, json, os, sys
from proxy.cli import build_parser
args = build_parser(["run"]).parse_args(["run", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                                           "--log", "/dev/null"])
import proxy.cli.worker
from proxy.cli.run import run_config_from, serve
from proxy.runner import ProxyRunner

runner = ProxyRunner(run_config_from(args))

async def main():
    def ready():
        names = [type(addon).__name__ for addon in runner.master.addons.chain]
        libraries = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")
                            if ".so" in line})
        print(json.dumps({"modules": sorted(sys.modules), "addons": names, "libraries": libraries,
                          "frozenlist_switch": os.environ.get("FROZENLIST_NO_EXTENSIONS")}), flush=True)
        asyncio.ensure_future(runner.stop())
    await serve(runner, ready)

asyncio.run(main())
"""

NOT_FOR_RUN = ("browser", "squid_compat", "playwright", "trafilatura", "lxml", "publicsuffixlist", "ldap3", "flask",
               "werkzeug", "jinja2", "proxy.suggest", "proxy.replay", "proxy.cli.browse", "proxy.cli.squid",
               "proxy.workers", "proxy.metrics_sum", "prometheus_client.parser")  # the last three: the supervisor's
CORE_ADDON_MODULES = {"mitmproxy.addons", "mitmproxy.addons.core", "mitmproxy.addons.proxyserver",
                      "mitmproxy.addons.next_layer", "mitmproxy.addons.tlsconfig", "mitmproxy.addons.disable_h2c",
                      "mitmproxy.addons.termlog"}  # termlog: mitmproxy.master imports it for its own log


@pytest.fixture(scope="module")
def loaded() -> dict:
    done = subprocess.run([sys.executable, "-P", "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_run_imports_nothing_only_other_commands_use(loaded: dict) -> None:
    unused = [name for name in loaded["modules"] if name.startswith(tuple(f"{p}." for p in NOT_FOR_RUN))
              or name in NOT_FOR_RUN]
    assert unused == []


def test_run_imports_only_the_core_mitmproxy_addons(loaded: dict) -> None:
    addon_modules = {name for name in loaded["modules"] if name.startswith("mitmproxy.addons")}
    assert addon_modules == CORE_ADDON_MODULES


# aiohttp's client half: its package __init__ imports it, the admin listener's server never uses it.
AIOHTTP_CLIENT = ("aiohttp.client", "aiohttp.connector", "aiohttp.cookiejar", "aiohttp.client_reqrep",
                  "aiohttp.client_ws", "aiohttp.client_proto", "aiohttp.client_middlewares", "aiohttp.tracing",
                  "aiohttp.payload_streamer", "aiohappyeyeballs")


def test_run_imports_aiohttp_s_server_without_its_client(loaded: dict) -> None:
    assert "aiohttp.web" in loaded["modules"]  # the admin listener is up
    assert [name for name in loaded["modules"] if name in AIOHTTP_CLIENT] == []


def test_aiohttp_still_works_whole_when_asked() -> None:
    """A name of aiohttp's own (``ClientSession``) runs its __init__ then; the version given beforehand to
    its server modules (the ``Server`` header) is the one the __init__ itself says."""
    code = ("import sys\nimport proxy.aiohttp_web\nimport aiohttp\nfrom aiohttp.http import SERVER_SOFTWARE\n"
            "given = aiohttp.__version__\nassert 'aiohttp.client' not in sys.modules\n"
            "session = aiohttp.ClientSession\n"
            "print(given, aiohttp.__version__, SERVER_SOFTWARE, 'aiohttp.client' in sys.modules, sep='|')")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    given, own, server_software, loaded_all = done.stdout.strip().split('|')
    assert given == own and server_software.endswith(f"aiohttp/{own}") and loaded_all == "True"


def test_run_loads_no_cxx_runtime(loaded: dict) -> None:
    """frozenlist (aiohttp's Application) is its pure-Python class: its C extension would load libstdc++."""
    assert "frozenlist" in loaded["modules"] and "frozenlist._frozenlist" not in loaded["modules"]
    assert [name for name in loaded["libraries"] if name.startswith("libstdc++")] == []
    assert loaded["frozenlist_switch"] is None  # set for that one import, not left for child processes


def test_the_frozenlist_switch_a_user_set_is_left_as_it_was() -> None:
    code = ("import os\nimport proxy.aiohttp_web\nimport frozenlist\n"
            "print(os.environ['FROZENLIST_NO_EXTENSIONS'], frozenlist.FrozenList is frozenlist.PyFrozenList)")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "FROZENLIST_NO_EXTENSIONS": "yes"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["yes", "True"]


def test_run_does_not_load_the_yaml_library_of_mitmproxy_s_options_files(loaded: dict) -> None:
    """mitmproxy.optmanager imports ruamel.yaml at its top; the embedded Master never reads an options file."""
    assert "mitmproxy.optmanager" in loaded["modules"]
    assert [name for name in loaded["modules"] if name.startswith("ruamel.yaml.")] == []


def test_mitmproxy_s_options_files_still_read_and_write_when_asked() -> None:
    code = ("import io, sys\nimport proxy.mitm_core\nfrom mitmproxy import exceptions, optmanager, options\n"
            "assert 'ruamel.yaml.main' not in sys.modules\n"
            "assert optmanager.parse('listen_port: 8081') == {'listen_port': 8081}\n"
            "try:\n    optmanager.parse('listen_port: [')\nexcept exceptions.OptionsError as err:\n"
            "    assert 'line 1' in str(err), err\nelse:\n    raise AssertionError('a broken file was read')\n"
            "out = io.StringIO()\noptmanager.dump_defaults(options.Options(), out)\n"
            "print('\\nlisten_port:' in out.getvalue())")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_the_master_still_has_every_addon_enforcement_needs(loaded: dict) -> None:
    addons = loaded["addons"]
    assert addons[:5] == ["Core", "Proxyserver", "NextLayer", "TlsConfig", "DisableH2C"]
    assert len(addons) > 5  # egresswall's own (proxy/addons/) follow, their next_layer after mitmproxy's


def test_the_addons_package_still_works_whole_when_asked(loaded: dict) -> None:
    """A name the package itself defines (mitmdump's default_addons) runs its __init__ then, once."""
    code = ("import sys\nfrom proxy.mitm_core import core_addons\nimport mitmproxy.addons as addons\n"
            "assert 'mitmproxy.addons.proxyauth' not in sys.modules\n"
            "print(len(addons.default_addons()), 'mitmproxy.addons.proxyauth' in sys.modules)")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    count, loaded_all = done.stdout.split()
    assert int(count) > 20 and loaded_all == "True"


def test_the_supervisor_of_workers_does_not_import_mitmproxy() -> None:
    """``run --workers N``: the supervisor starts workers and never proxies (proxy/run_config.py)."""
    code = ("import sys\nfrom proxy.cli import build_parser\nbuild_parser(['run'])\n"
            "import proxy.cli.run, proxy.workers\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'mitmproxy'))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_supervisor_names_mitmproxy_s_own_ca_directory() -> None:
    from mitmproxy.options import CONF_DIR

    from proxy.cli.run import MITMPROXY_CONF_DIR

    assert MITMPROXY_CONF_DIR == CONF_DIR
