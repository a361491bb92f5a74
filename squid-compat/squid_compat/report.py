"""Where a squid.conf line came from, and what the translation says about it."""

from __future__ import annotations

from dataclasses import dataclass

WARNING, NOTE = "warning", "note"

_SURROGATE_ESCAPES = range(0xDC80, 0xDD00)  # bytes that were not UTF-8, as Python decodes them


def printable(text: str) -> str:
    """The text with every character that is not printable written as an escape (``\\x0a``, ``\\u2028``).

    Text from a squid.conf goes to a terminal and into comments of the output YAML: a file name can hold a
    newline, a value a vertical tab, a NEL or a line separator (which YAML reads as a line break), or bytes
    that are not UTF-8. Escaped, none of them can end a comment line, break the YAML or drive a terminal."""
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code in _SURROGATE_ESCAPES:
        return f"\\x{code - 0xDC00:02x}"  # the original byte
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


@dataclass(frozen=True, order=True)
class Where:
    """A position in a squid.conf (or an included file, or a file of ACL values)."""

    file: str
    line: int = 0

    def __str__(self) -> str:
        name = printable(self.file)
        return f"{name}:{self.line}" if self.line else name


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
        return printable(f"{self.where or '-'}: {self.level}: {self.message}")
