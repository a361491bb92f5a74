"""mitmproxy's core addons, imported without the other thirty-odd of the ``mitmproxy.addons`` package.

The embedded Master (``proxy/runner.py``) loads five of mitmproxy's addons. Importing any of them runs
``mitmproxy/addons/__init__.py`` first, which imports every addon mitmdump loads: proxy authentication
(ldap3), the onboarding web app (flask, werkzeug, jinja2), export, save, script loading, playback...
About 300 modules and 15 MiB per process that egresswall never uses.

So the package is entered without running its ``__init__`` (``proxy/lazy_package.py``): submodules import
as ever, and the ``__init__`` runs the first time something asks the package for a name that is not a
submodule (``default_addons``, in a process that also runs mitmdump's code). Nothing about an addon
changes: the classes are mitmproxy's own.
"""

from __future__ import annotations

import types

from .lazy_package import enter_package_lazily

# Before anything imports mitmproxy.master (which imports an addon, hence the whole package).
enter_package_lazily("mitmproxy.addons")
# mitmproxy.optmanager imports ruamel.yaml at its top for reading and writing options files, which the
# embedded Master never does (egresswall's options come from its own command line and policy): about
# 30 modules and 1.5 MiB. Its package is entered the same way, and runs whole on first use.
enter_package_lazily("ruamel.yaml")

from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig  # noqa: E402
from mitmproxy.master import Master  # noqa: E402

__all__ = ["DisableH2C", "Master", "core_addons", "leave_answered_flows"]


class DisableH2C(disable_h2c.DisableH2C):
    """mitmproxy's DisableH2C, which kills an HTTP/2 connection preface (``PRI * HTTP/2.0``) in its
    ``request`` hook, except where egresswall has already answered the flow: inside an intercepted tunnel
    egresswall refuses the preface ``505 http:version`` in ``requestheaders``, records it, and mitmproxy
    then ran this hook anyway and killed the flow, so the client read nothing of the answer its record
    named (tests/test_review_round20.py)."""

    def request(self, f) -> None:
        if f.response is None:
            self.process_flow(f)


def leave_answered_flows(addons) -> None:
    """Give stock mitmdump's own DisableH2C (``addons``: its AddonManager) the hook above, for the mitmdump
    shim, where mitmdump loads that addon before egresswall's."""
    stock = addons.get("disableh2c")
    if stock is not None and not isinstance(stock, DisableH2C):
        stock.request = types.MethodType(DisableH2C.request, stock)


def core_addons() -> list[object]:
    """Fresh instances of the five core addons egresswall's Master needs, in the order they must run:
    Core (options and commands), Proxyserver (the listener), NextLayer (before egresswall's own next_layer
    hook, which has the final say), TlsConfig (certificates for interception), DisableH2C."""
    return [core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(),
            DisableH2C()]
