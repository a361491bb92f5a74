"""What a supervisor and its worker processes tell each other (``egresswall run --workers N``).

No command line is rewritten and no human line is parsed:

* **Configuration.** The supervisor starts ``python -P -m proxy.cli.worker`` and writes ONE JSON
  document to the worker's standard input, then closes it (``WorkerConfig.to_json``)::

      {"run": {<every RunConfig field>}, "ready_fd": 3}

  ``run`` is the ``RunConfig`` the supervisor built from the parsed options (its listen address, the
  worker's loopback admin port, SO_REUSEPORT, the worker count, the supervisor's own admin listener as
  an address the proxy must never connect to). An unknown or missing field is refused.

* **Readiness.** The worker inherits the write end of a pipe as file descriptor ``ready_fd`` and writes
  exactly ONE JSON line to it, then closes it::

      {"event": "ready", "pid": 1234, "listen": ["127.0.0.1", 3128], "admin": ["127.0.0.1", 40123]}
      {"event": "failed", "error": "<one line for people>", "exit": 2}

  End of file without a line means the worker died before it could say anything; its standard error
  (which the supervisor relays, prefixed ``[worker N]``) says why.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from policy.loader import Overrides

from .runner import RunConfig

READY, FAILED = "ready", "failed"
_RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(RunConfig))


@dataclass(frozen=True)
class WorkerConfig:
    run: RunConfig
    ready_fd: int

    def to_json(self) -> str:
        return json.dumps({"run": dataclasses.asdict(self.run), "ready_fd": self.ready_fd})

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"run", "ready_fd"}:
            raise ValueError("a worker configuration is an object with exactly 'run' and 'ready_fd'")
        if not isinstance(data["ready_fd"], int) or isinstance(data["ready_fd"], bool) or data["ready_fd"] < 0:
            raise ValueError("ready_fd must be a file descriptor number")
        return cls(run=_run_config(data["run"]), ready_fd=data["ready_fd"])


def _run_config(data: Any) -> RunConfig:
    if not isinstance(data, dict):
        raise ValueError("'run' must be an object")
    unknown, missing = set(data) - _RUN_FIELDS, _RUN_FIELDS - set(data)
    if unknown or missing:
        raise ValueError(f"'run' fields differ from RunConfig: unknown {sorted(unknown)}, missing {sorted(missing)}")
    values = dict(data)
    values["overrides"] = Overrides(**_object(values["overrides"], "overrides"))
    values["listen"] = _address(values["listen"])
    values["admin"] = None if values["admin"] is None else _address(values["admin"])
    values["extra_self_endpoints"] = tuple(_address(a) for a in values["extra_self_endpoints"])
    return RunConfig(**values)


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be an object")
    return value


def _address(value: Any) -> tuple[str, int]:
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or not isinstance(value[1], int) or isinstance(value[1], bool) or not 0 <= value[1] <= 65535):
        raise ValueError(f"an address is [host, port], got {value!r}")
    return value[0], value[1]


# ---- the readiness report -------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerReport:
    event: str  # READY or FAILED
    listen: tuple[str, int] | None = None
    admin: tuple[str, int] | None = None
    pid: int | None = None
    error: str | None = None  # FAILED: one line for people
    exit: int | None = None  # FAILED: the exit status the worker ends with

    def to_line(self) -> bytes:
        if self.event == READY:
            data: dict[str, Any] = {"event": READY, "pid": self.pid, "listen": self.listen, "admin": self.admin}
        else:
            data = {"event": FAILED, "error": self.error, "exit": self.exit}
        return (json.dumps(data) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> WorkerReport:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a worker report is a JSON object")
        if data.get("event") == READY and set(data) == {"event", "pid", "listen", "admin"}:
            return cls(READY, listen=_address(data["listen"]),
                       admin=None if data["admin"] is None else _address(data["admin"]), pid=int(data["pid"]))
        if data.get("event") == FAILED and set(data) == {"event", "error", "exit"}:
            return cls(FAILED, error=str(data["error"]), exit=int(data["exit"]))
        raise ValueError(f"not a worker report: {line[:200]!r}")
