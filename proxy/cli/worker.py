"""``python -P -m proxy.cli.worker``: one worker of ``egresswall run --workers N``.

It reads its configuration from standard input and reports ready or failed on the pipe the
configuration names; ``proxy/worker_config.py`` describes both. Not for people: the supervisor
(``proxy/workers.py``) starts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

from proxy import event_loop
from proxy.runner import ProxyRunner
from proxy.worker_config import FAILED, READY, WorkerConfig, WorkerReport

from . import logs
from .errors import EXIT_BUG, EXIT_INTERRUPTED, UsageError, describe
from .run import serve


def main() -> int:
    _die_with_supervisor()
    try:
        config = WorkerConfig.from_json(sys.stdin.read())
    except ValueError as err:  # the supervisor sent what this worker cannot read: a bug, said on stderr
        print(f"egresswall: {describe(err)[0]}", file=sys.stderr, flush=True)
        return EXIT_BUG
    logs.configure()
    with os.fdopen(config.ready_fd, "wb", buffering=0) as report:
        try:
            runner = ProxyRunner(config.run)
            upstream = runner.holder.policy.upstream
            if upstream is not None and config.run.worker_count > 1:
                # As `run --workers` refuses at start: a worker restarted after a reload the pool refused for its
                # upstream would otherwise serve that policy beside workers on the last good one (review round 23).
                raise UsageError(f"--workers {config.run.worker_count}: not supported with an upstream proxy "
                                 f"({upstream.url}); the policy file now names one, which the running workers "
                                 "refused on reload: this worker stays down")
            event_loop.run(serve(runner, lambda: report.write(_ready(runner).to_line())), config.run.uvloop)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except Exception as err:
            message, status = describe(err)
            if not _tell(report, WorkerReport(FAILED, error=message, exit=status)):
                print(f"egresswall: {message}", file=sys.stderr, flush=True)
            return status
    return 0


def _ready(runner: ProxyRunner) -> WorkerReport:
    assert runner.listen_address is not None
    return WorkerReport(READY, listen=runner.listen_address[:2], pid=os.getpid(),
                        admin=runner.admin_address[:2] if runner.admin_address else None)


def _tell(report, message: WorkerReport) -> bool:
    """The report if the pipe still takes it (it does not after a ready line was sent: read once)."""
    try:
        report.write(message.to_line())
        return True
    except OSError:
        return False


def _die_with_supervisor() -> None:
    """A worker must not outlive its supervisor (it would keep serving the port unsupervised): ask the
    kernel for SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the supervisor died before the request took effect
        raise SystemExit("egresswall: worker started without its supervisor")


if __name__ == "__main__":
    sys.exit(main())
