"""Reading squid.conf the way squid 5 does: one directive per line, ``\\`` continues a line, ``#`` at
the start of a token starts a comment, ``include`` pulls in files (globs allowed), and an ACL value
written as ``"/path"`` (or ``parameters("/path")``) names a file of values, one per line.

Differences from squid, all reported: a relative ``include`` or value-file path is looked up next to
the file that names it when it does not exist relative to the current directory (squid only tries the
current directory), and conditional sections (``if``/``else``/``endif``) are refused, because which
branch squid takes depends on the running process.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .report import NOTE, WARNING, Note, Where

MAX_INCLUDE_DEPTH = 16  # squid's limit
_PARAMETERS = re.compile(r'parameters\("(.*)"\)$')
_MACRO = re.compile(r"\$\{[A-Za-z_]+\}")


class ConfError(ValueError):
    """A squid.conf that cannot be translated at all (unreadable, conditional sections)."""


@dataclass(frozen=True)
class Directive:
    name: str
    args: tuple[str, ...]  # quoted tokens keep their quotes: '"/etc/squid/sites.txt"'
    where: Where
    text: str  # the whole (joined) line, for comments in the output

    @property
    def base(self) -> Path:
        return Path(self.where.file).parent


def read_conf(path: str | Path) -> tuple[list[Directive], list[Note]]:
    """Every directive of a squid.conf and its includes, in the order squid reads them."""
    notes: list[Note] = []
    directives: list[Directive] = []
    _read_file(Path(path), directives, notes, depth=0, seen=())
    return directives, notes


def read_conf_text(text: str, source: str = "squid.conf") -> tuple[list[Directive], list[Note]]:
    """The same for text in memory (tests); includes are resolved relative to the current directory."""
    notes: list[Note] = []
    directives: list[Directive] = []
    _read_lines(text, Path(source), directives, notes, depth=0, seen=(source,))
    return directives, notes


def _read_file(path: Path, directives: list[Directive], notes: list[Note], depth: int,
               seen: tuple[str, ...], where: Where | None = None) -> None:
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as err:
        named = f"{where}: include {path}" if where else str(path)
        raise ConfError(f"{named}: cannot be read: {err.strerror or err}") from None
    _read_lines(text, path, directives, notes, depth, (*seen, str(path.resolve())))


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) with backslash continuations joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not pending:
            start = number
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            pending += line[:-1]
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def tokens(line: str) -> list[str]:
    """Whitespace-separated tokens; a token starting with '#' ends the line; "..." keeps its quotes."""
    out: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i].isspace():
            i += 1
            continue
        if line[i] == "#":
            break
        if line[i] == '"':
            end = i + 1
            while end < n and line[end] != '"':
                end += 2 if line[end] == "\\" else 1
            out.append(line[i:end + 1])
            i = end + 1
            continue
        end = i
        while end < n and not line[end].isspace():
            end += 1
        out.append(line[i:end])
        i = end
    return out


def _read_lines(text: str, path: Path, directives: list[Directive], notes: list[Note], depth: int,
                seen: tuple[str, ...]) -> None:
    for number, line in _logical_lines(text):
        words = tokens(line)
        if not words:
            continue
        where = Where(str(path), number)
        name = words[0]
        if name in ("if", "else", "endif"):
            raise ConfError(f"{where}: conditional sections (if/else/endif) are not supported: which branch squid "
                            "takes depends on the running process; flatten the configuration and import that")
        if _MACRO.search(line):
            notes.append(Note(where, f"{name}: squid expands macros such as ${{process_number}} here; they are "
                                     "read literally", "macro"))
        if name == "include":
            _include(words[1:], where, path, directives, notes, depth, seen)
            continue
        directives.append(Directive(name, tuple(words[1:]), where, " ".join(words)))


def _include(patterns: list[str], where: Where, path: Path, directives: list[Directive], notes: list[Note],
             depth: int, seen: tuple[str, ...]) -> None:
    if depth + 1 > MAX_INCLUDE_DEPTH:
        notes.append(Note(where, f"include nested deeper than {MAX_INCLUDE_DEPTH} levels (squid's limit); not "
                                 "followed", "include"))
        return
    if not patterns:
        notes.append(Note(where, "include without a file name", "include"))
    for pattern in patterns:
        pattern = pattern.strip('"')
        matches = sorted(glob.glob(pattern))
        if not matches and not os.path.isabs(pattern):
            matches = sorted(glob.glob(str(path.parent / pattern)))
            if matches:
                notes.append(Note(where, f"include {pattern}: found next to {path.name}; squid resolves relative "
                                         "paths from its current directory", "include", NOTE))
        if not matches and not glob.has_magic(pattern):
            raise ConfError(f"{where}: include {pattern}: no such file (squid would refuse to start)")
        if not matches:
            notes.append(Note(where, f"include {pattern}: no file matches; nothing included", "include", NOTE))
        for match in matches:
            resolved = str(Path(match).resolve())
            if resolved in seen:
                notes.append(Note(where, f"include {match}: includes itself (a cycle); not followed", "include"))
                continue
            _read_file(Path(match), directives, notes, depth + 1, seen, where)


def value_file(token: str) -> str | None:
    """The file named by an ACL value written as "/path" or parameters("/path"), else None."""
    if len(token) >= 2 and token.startswith('"') and token.endswith('"'):
        return token[1:-1]
    match = _PARAMETERS.match(token)
    return match.group(1) if match else None


def expand_values(args: list[str], directive: Directive, notes: list[Note]) -> tuple[list[tuple[str, Where]], bool]:
    """ACL values with where each was written: inline, or one per line of a quoted value file
    (squid reads the first word of each line and skips '#' comments). The flag is False when a value
    file could not be read: the ACL's values are then not known."""
    out: list[tuple[str, Where]] = []
    complete = True
    for token in args:
        name = value_file(token)
        if name is None:
            out.append((token, directive.where))
            continue
        path = Path(name)
        if not path.is_absolute() and not path.exists():
            path = directive.base / name
        try:
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as err:
            notes.append(Note(directive.where, f"value file {name}: cannot be read ({err.strerror or err}); the "
                                               "ACL is treated as undecided (squid would refuse to start)",
                              "value-file", WARNING))
            complete = False
            continue
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if words and not words[0].startswith("#"):
                out.append((words[0], Where(str(path), number)))
    return out, complete
