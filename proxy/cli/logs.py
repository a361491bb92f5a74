"""How the commands talk to people on standard error: ``egresswall: <message>``, one line each."""

from __future__ import annotations

import logging
import sys


class _OwnListenFailures(logging.Filter):
    """Drops mitmproxy's message about a listener it could not open. egresswall reports that failure
    itself (``proxy/listeners.py``), in one line that names egresswall's option; mitmproxy's message
    advises ``--mode regular@PORT``, an option egresswall does not have."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to listen on" not in record.getMessage()


def configure(quiet_libraries: tuple[str, ...] = ()) -> None:
    logging.basicConfig(level=logging.INFO, format="egresswall: %(message)s", stream=sys.stderr)
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)  # one line per connection is not for operators
    logging.getLogger("mitmproxy.addons.proxyserver").addFilter(_OwnListenFailures())
    for name in quiet_libraries:
        logging.getLogger(name).setLevel(logging.WARNING)
