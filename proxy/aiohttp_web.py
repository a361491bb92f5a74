"""aiohttp's server (``aiohttp.web``), imported without aiohttp's client.

The admin listener (``proxy/admin.py``) and the session API (``proxy/sessions/api.py``) serve with aiohttp and
never make a request. Importing ``aiohttp.web`` runs ``aiohttp/__init__.py`` first, which imports the client
as well: the connector with happy eyeballs, the cookie jar, the client's requests, responses, WebSockets,
tracing and middlewares, payloads — about 20 modules and 4 MiB in every process that has an admin listener
(each worker and the supervisor of ``--workers N``; README, "Idle memory").

So the package is entered without running its ``__init__`` (``proxy/lazy_package.py``): ``aiohttp.web`` and
what it imports load as ever, and the ``__init__`` runs the first time something asks ``aiohttp`` for one of
its own names (``aiohttp.ClientSession``, in a test). The one name aiohttp's server modules take from the
package itself is ``__version__`` (``aiohttp.http``, for the ``Server`` header): it is the installed
distribution's version, which is what the ``__init__`` says (``tests/test_idle_footprint.py`` checks both
agree). The classes are aiohttp's own.

And frozenlist (the lists aiohttp's Application freezes: its signals and middlewares) is imported with its
own switch ``FROZENLIST_NO_EXTENSIONS`` set, for that import only: its C extension is C++ and loads
libstdc++, 1.5 MiB of every admin-serving process for a few lists a request walks once. The pure-Python
class is frozenlist's own and behaves the same (frozenlist tests both).
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

from .lazy_package import enter_package_lazily

FROZENLIST_SWITCH = "FROZENLIST_NO_EXTENSIONS"


def _enter() -> None:
    try:
        version = metadata.version("aiohttp")
    except metadata.PackageNotFoundError:
        return  # no distribution metadata to take the version from: import the whole package
    enter_package_lazily("aiohttp", __version__=version)


def _import_frozenlist_in_python() -> None:
    if "frozenlist" in sys.modules:
        return  # imported already, whichever way
    before = os.environ.get(FROZENLIST_SWITCH)
    os.environ[FROZENLIST_SWITCH] = "1"
    try:
        importlib.import_module("frozenlist")
    finally:  # the switch is for this import, not for this process's children
        if before is None:
            del os.environ[FROZENLIST_SWITCH]
        else:
            os.environ[FROZENLIST_SWITCH] = before


_enter()  # before anything imports aiohttp
_import_frozenlist_in_python()

from aiohttp import web  # noqa: E402
from aiohttp.http_exceptions import HttpProcessingError  # noqa: E402  (what aiohttp answers 400 for)

__all__ = ["HttpProcessingError", "web"]
