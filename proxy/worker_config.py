"""What a supervisor and its worker processes tell each other (``egresswall run --workers N``).

No command line is rewritten and no human line is parsed:

* **Configuration.** The supervisor starts ``python -P -m proxy.cli.worker`` and writes ONE JSON
  document to the worker's standard input, then closes it (``WorkerConfig.to_json``)::

      {"run": {<every RunConfig field>}, "ready_fd": 3}

  ``run`` is the ``RunConfig`` the supervisor built from the parsed options (its listen address, the
  worker's admin listener as a Unix socket path (``admin_socket``), SO_REUSEPORT, the worker count, the
  supervisor's own admin listener as an address the proxy must never connect to). An unknown or missing
  field is refused.

* **Readiness.** The worker inherits the write end of a pipe as file descriptor ``ready_fd`` and writes
  exactly ONE JSON line to it, then closes it::

      {"event": "ready", "pid": 1234, "listen": ["127.0.0.1", 3128], "admin": null}

  (``admin`` is the TCP admin listener of a worker started with one, as the tests do; a supervisor's
  workers listen on their ``admin_socket`` instead.)
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

from .run_config import RunConfig

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
    values = {}
    for name, value in data.items():
        decode = _DECODERS.get(name) or _SCALARS.get(_RUN_TYPES[name])
        if decode is None:  # a RunConfig field of a kind this codec does not know: teach it (below)
            raise ValueError(f"'run.{name}': a field of type {_RUN_TYPES[name]} has no decoder")
        values[name] = decode(value, f"run.{name}")
    return RunConfig(**values)


def _scalar(*kinds: type | None):
    def decode(value: Any, where: str) -> Any:
        if type(value) in [k for k in kinds if k is not None] or (value is None and None in kinds):
            return value
        if float in kinds and type(value) is int:
            return float(value)
        raise ValueError(f"'{where}': got {value!r}")
    return decode


def _overrides(value: Any, where: str) -> Overrides:
    if not isinstance(value, dict):
        raise ValueError(f"'{where}' must be an object")
    known = {f.name: str(f.type) for f in dataclasses.fields(Overrides)}
    if set(value) != set(known):
        raise ValueError(f"'{where}' fields differ from Overrides: {sorted(set(value) ^ set(known))}")
    for name, item in value.items():
        if known[name].startswith("list"):
            ok = isinstance(item, list) and all(isinstance(v, str) for v in item)
        else:
            ok = item is None or isinstance(item, str)
        if not ok:
            raise ValueError(f"'{where}.{name}': got {item!r}")
    return Overrides(**value)


def _optional_address(value: Any, where: str) -> tuple[str, int] | None:
    return None if value is None else _address(value)


def _addresses(value: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, list):
        raise ValueError(f"'{where}' must be a list of addresses")
    return tuple(_address(a) for a in value)


_RUN_TYPES = {f.name: str(f.type) for f in dataclasses.fields(RunConfig)}
_SCALARS = {"str": _scalar(str), "str | None": _scalar(str, None), "bool": _scalar(bool), "int": _scalar(int),
            "float": _scalar(float)}
_DECODERS = {"overrides": _overrides, "listen": lambda v, where: _address(v), "admin": _optional_address,
             "extra_self_endpoints": _addresses}


def _is_int(value: Any) -> bool:
    return type(value) is int


def _address(value: Any, where: str = "address") -> tuple[str, int]:
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or not isinstance(value[1], int) or isinstance(value[1], bool) or not 0 <= value[1] <= 65535):
        raise ValueError(f"'{where}': an address is [host, port], got {value!r}")
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
        if data.get("event") == READY and set(data) == {"event", "pid", "listen", "admin"} and _is_int(data["pid"]):
            return cls(READY, listen=_address(data["listen"]), admin=_optional_address(data["admin"], "admin"),
                       pid=data["pid"])
        if (data.get("event") == FAILED and set(data) == {"event", "error", "exit"} and isinstance(data["error"], str)
                and _is_int(data["exit"])):
            return cls(FAILED, error=data["error"], exit=data["exit"])
        raise ValueError(f"not a worker report: {line[:200]!r}")
