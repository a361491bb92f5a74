"""mitmproxy's core addons, imported without the other thirty-odd of the ``mitmproxy.addons`` package.

The embedded Master (``proxy/runner.py``) loads five of mitmproxy's addons. Importing any of them runs
``mitmproxy/addons/__init__.py`` first, which imports every addon mitmdump loads: proxy authentication
(ldap3), the onboarding web app (flask, werkzeug, jinja2), export, save, script loading, playback...
About 300 modules and 15 MiB per process that egresswall never uses.

So the package is entered without running its ``__init__``: its module object is made from its own spec
(same name, same ``__path__``, so submodules import as ever) and the ``__init__`` runs the first time
something asks the package for a name that is not a submodule (``default_addons``, in a process that
also runs mitmdump's code). Nothing about an addon changes: the classes are mitmproxy's own.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

PACKAGE = "mitmproxy.addons"


def _enter_package_lazily() -> None:
    if PACKAGE in sys.modules:
        return  # already imported (mitmdump, or mitmproxy's test helpers): nothing to save
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not a package as expected: import it the ordinary way
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)  # probes for __wrapped__, __file__... need not load every addon
        if importlib.util.find_spec(f"{PACKAGE}.{name}") is not None:
            return importlib.import_module(f"{PACKAGE}.{name}")  # a submodule: that one only
        _run_init(package)  # a name the package itself defines: run its __init__ now, once
        return getattr(package, name)

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[PACKAGE] = package
    parent = importlib.import_module("mitmproxy")
    parent.addons = package  # type: ignore[attr-defined]


def _run_init(package: ModuleType) -> None:
    del package.__getattr__
    assert package.__spec__ is not None and package.__spec__.loader is not None
    package.__spec__.loader.exec_module(package)


# Before anything imports mitmproxy.master (which imports an addon, hence the whole package).
_enter_package_lazily()

from mitmproxy.addons import core, disable_h2c, next_layer, proxyserver, tlsconfig  # noqa: E402
from mitmproxy.master import Master  # noqa: E402

__all__ = ["Master", "core_addons"]


def core_addons() -> list[object]:
    """Fresh instances of the five core addons egresswall's Master needs, in the order they must run:
    Core (options and commands), Proxyserver (the listener), NextLayer (before egresswall's own next_layer
    hook, which has the final say), TlsConfig (certificates for interception), DisableH2C."""
    return [core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(), tlsconfig.TlsConfig(),
            disable_h2c.DisableH2C()]
