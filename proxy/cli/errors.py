"""How a command that fails says so: one line on standard error, never a traceback for a failure
egresswall expects (a bad policy, a taken port, a missing file), and for anything else one line that
says it is a bug and where the traceback was written.

Exit status: 2 for usage and environment errors (``EXIT_USAGE``), 70 for a bug (``EXIT_BUG``,
sysexits' EX_SOFTWARE), 130 after Ctrl-C, 141 (128 + SIGPIPE) when the reader of standard output went away.
"""

from __future__ import annotations

import datetime
import errno
import os
import sys
import tempfile
import traceback

from policy.loader import PolicyError
from proxy.listeners import ADMIN, BROWSER_SERVER, PROXY, ListenError
from proxy.upstream import UpstreamError

EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 70, 130, 141
_OPTION = {PROXY: "--listen HOST:PORT", ADMIN: "--admin HOST:PORT (or --no-admin)",
           BROWSER_SERVER: "--host and --port"}


class UsageError(ValueError):
    """A command line that cannot be run as given; the message says which option and why."""


def describe(err: BaseException) -> tuple[str, int]:
    """(one line for people, exit status) for a failure that ended a command."""
    if isinstance(err, ListenError):
        return f"{err}; {_listen_advice(err)}", EXIT_USAGE
    if isinstance(err, (PolicyError, UsageError, UpstreamError, *_imported(_WRITTEN_TO_BE_READ))):
        return str(err), EXIT_USAGE  # written to be read as they are (file:line:column: ...)
    if isinstance(err, OSError) and (err.filename is not None or isinstance(err, PermissionError)):
        where = f": {err.filename}" if err.filename is not None else ""
        return f"{(err.strerror or str(err)).lower()}{where}", EXIT_USAGE
    return _report_bug(err), EXIT_BUG


# Errors of the commands that use the browser or the squid translator, by module and name: `run` imports
# neither module (each costs memory in every worker), and an error of a class never imported cannot occur.
_WRITTEN_TO_BE_READ = (("browser.launch", "ContainmentError"), ("squid_compat.conf", "ConfError"))


def _imported(classes: tuple[tuple[str, str], ...]) -> list[type]:
    return [getattr(sys.modules[module], name) for module, name in classes if module in sys.modules]


def _listen_advice(err: ListenError) -> str:
    option = _OPTION.get(err.listener, "another address")
    port = err.address[1]
    if err.errno == errno.EADDRINUSE:
        return (f"another program already listens there (`ss -ltnp 'sport = :{port}'` shows which): stop it, "
                f"or choose a free port with {option}")
    if err.errno == errno.EADDRNOTAVAIL:
        return f"no interface of this machine has that address: choose one it has (or 0.0.0.0 for all) with {option}"
    if err.errno == errno.EACCES:
        return f"ports below 1024 need root or CAP_NET_BIND_SERVICE: choose a port above 1023 with {option}"
    if err.name_not_found:
        return f"that host name does not resolve here: give an IP address of this machine with {option}"
    return f"choose another address with {option}"


def _report_bug(err: BaseException) -> str:
    """Write the traceback to a file of its own and say where: the operator gets one line, the bug
    report gets everything."""
    details = "".join(traceback.format_exception(err))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        fd, path = tempfile.mkstemp(prefix=f"egresswall-bug-{stamp}-", suffix=".txt")
        with os.fdopen(fd, "w") as out:
            out.write(f"egresswall {' '.join(sys.argv[1:])}\n\n{details}")
        where = f"the details (a traceback) are in {path}; please attach that file to a bug report"
    except OSError:
        sys.stderr.write(details)  # nowhere to put it: then it goes here, after all
        where = "the traceback is above; please include it in a bug report"
    return f"internal error, a bug in egresswall: {type(err).__name__}: {_one_line(str(err), 200)}; {where}"


def _one_line(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
