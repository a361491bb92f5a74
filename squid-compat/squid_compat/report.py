"""Where a squid.conf line came from, and what the translation says about it."""

from __future__ import annotations

from dataclasses import dataclass

WARNING, NOTE = "warning", "note"


@dataclass(frozen=True, order=True)
class Where:
    """A position in a squid.conf (or an included file, or a file of ACL values)."""

    file: str
    line: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


BUILT_IN = Where("squid built-in")


@dataclass(frozen=True)
class Note:
    """One thing an operator should read. ``level`` is WARNING (the result differs from squid, or a
    line was not translated) or NOTE (information: a directive that is not access control).
    ``category`` is a short stable id, listed in squid-compat/README.md."""

    where: Where | None
    message: str
    category: str
    level: str = WARNING

    def __str__(self) -> str:
        return f"{self.where or '-'}: {self.level}: {self.message}"
