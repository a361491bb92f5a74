"""Reading squid.conf the way squid 5 does (``parseOneConfigFile`` in src/cache_cf.cc, ``ConfigParser``).

squid reads bytes, not text, and only a few of them are special:

* a line is what one ``fgets`` into an 8 KB buffer returns; it ends at its first newline, carriage return or
  NUL byte (the rest is dropped), and C ``isspace`` (space, tab, \\n, \\v, \\f, \\r) is trimmed around it;
* a line whose first character is ``#``, or an empty one, is skipped, inside a ``\\`` continuation too: a
  line ending in ``\\`` is joined to the next line squid keeps, with no space in between; a continuation
  still open at the end of the file is dropped;
* tokens are separated by squid's ``w_space`` only: space, tab, \\n and \\r (a no-break space, a vertical
  tab or a form feed is part of a token); a token starting with ``#`` ends the line; in a regular
  expression a ``\\`` takes the next character into the token, a space included;
* quotes are not special (``configuration_includes_quoted_values off``, squid's default): an ACL value
  starting with ``"`` or ``'`` names a file of values (up to the next quote), ``parameters("...")`` is a
  value like any other;
* ``include`` pulls in files (globs; one that matches nothing stops squid), ``if``/``else``/``endif``
  choose lines at startup.

Differences from squid, all reported: a relative ``include`` or value-file path is looked up next to the
file that names it when it does not exist relative to the current directory (squid only tries the
current directory), and conditional sections are refused, because which branch squid takes depends on the
running process.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from .report import NOTE, WARNING, Note, Where

MAX_INCLUDE_DEPTH = 16  # squid's limit
CONF_LINE_BUFFER = 8192  # squid reads squid.conf with fgets into a buffer of BUFSIZ bytes
VALUE_LINE_BUFFER = 2048  # and value files into one of CONFIG_LINE_LIMIT bytes
W_SPACE = " \t\n\r"  # squid's w_space: the only characters that separate tokens
C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale (squid never sets a locale): trimmed around lines
CONDITIONALS = ("if", "else", "endif")
_MACRO = re.compile(r"\$\{[A-Za-z_]+\}")


class ConfError(ValueError):
    """A squid.conf that cannot be translated at all (unreadable, conditional sections, a line squid refuses)."""


@dataclass(frozen=True)
class Directive:
    name: str
    rest: str  # the line after the directive's name, as squid's token parser reads it
    where: Where
    text: str  # the whole (joined) line, for comments in the output

    @property
    def args(self) -> tuple[str, ...]:
        return tuple(tokens(self.rest))

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
    _read_bytes(text.encode("utf-8", "surrogateescape"), Path(source), directives, notes, depth=0, seen=(source,))
    return directives, notes


def _read_file(path: Path, directives: list[Directive], notes: list[Note], depth: int,
               seen: tuple[str, ...], where: Where | None = None) -> None:
    try:
        data = path.read_bytes()
    except OSError as err:
        named = f"{where}: include {path}" if where else str(path)
        raise ConfError(f"{named}: cannot be read: {err.strerror or err}") from None
    _read_bytes(data, path, directives, notes, depth, (*seen, str(path.resolve())))


# ---- lines ------------------------------------------------------------------------------------------

def fgets_pieces(data: bytes, size: int) -> Iterator[bytes]:
    """What successive ``fgets(buffer, size, file)`` calls return: up to and including a newline, or
    ``size - 1`` bytes when the line is longer (its rest is then the next piece: squid counts it as a line)."""
    start = 0
    while start < len(data):
        newline = data.find(b"\n", start, start + size - 1)
        stop = newline + 1 if newline != -1 else min(start + size - 1, len(data))
        yield data[start:stop]
        start = stop


def c_string(piece: bytes) -> str:
    """What C string functions see of a piece: the bytes before the first NUL. Bytes that are not UTF-8
    are kept (as surrogate escapes) so that nothing squid compares byte for byte is lost."""
    return piece.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _physical_line(piece: bytes) -> str:
    """One line as squid keeps it: cut at its first \\n or \\r, leading C whitespace removed."""
    return c_string(piece).split("\n", 1)[0].split("\r", 1)[0].lstrip(C_SPACE)


def logical_lines(data: bytes, path: Path, notes: list[Note]) -> list[tuple[int, str]]:
    """(line number of the first piece, text) for each line squid processes, continuations joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, piece in enumerate(fgets_pieces(data, CONF_LINE_BUFFER), 1):
        line = _physical_line(piece)
        if not line or line.startswith("#"):
            continue  # squid skips comments and blank lines before it looks for a continuation
        if not pending:
            start = number
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]  # joined to the next line squid keeps, without a space
            continue
        out.append((start, pending.rstrip(C_SPACE)))
        pending = ""
    if pending:
        notes.append(Note(Where(str(path), start), "the last line ends with a '\\' continuation and no line follows: "
                                                   "squid ignores it; ignored", "syntax"))
    return out


# ---- tokens -----------------------------------------------------------------------------------------

def _token_spans(text: str, regex: bool = False) -> Iterator[tuple[int, int]]:
    """Where squid's tokens are (``ConfigParser::TokenParse``, quoted values off): separated by ``w_space``;
    a token starting with ``#`` ends the line. With ``regex`` (``RegexStrtokFile``), a backslash takes the
    next character into the token, whatever it is."""
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in W_SPACE:
            i += 1
        if i >= n or text[i] == "#":
            return
        start = i
        while i < n and text[i] not in W_SPACE:
            i += 2 if regex and text[i] == "\\" else 1
        yield start, min(i, n)


def tokens(text: str, regex: bool = False) -> list[str]:
    return [text[start:end] for start, end in _token_spans(text, regex)]


def take_tokens(text: str, count: int) -> tuple[list[str], str]:
    """The first ``count`` tokens of the text (fewer when the line has fewer) and the text after them."""
    spans = list(islice(_token_spans(text), count))
    rest = text[spans[-1][1]:] if len(spans) == count else ""
    return [text[start:end] for start, end in spans], rest


def parse_directive(line: str, where: Where) -> Directive:
    """One processed line as a directive: ``parse_line`` takes the first token (``strtok(line, w_space)``)
    as its name; the rest of the line starts after the one character that ended it."""
    end = next((i for i, ch in enumerate(line) if ch in W_SPACE), len(line))
    return Directive(line[:end], line[end + 1:], where, line)


def _statement(line: str, word: str) -> bool:
    """squid's ``FindStatement``: the line is this word, alone or followed by C whitespace."""
    return line.startswith(word) and (len(line) == len(word) or line[len(word)] in C_SPACE)


def include_names(text: str) -> list[str]:
    """The file names of an ``include`` line, split as squid's ``strwordtok`` does: on C whitespace;
    ``"..."`` quotes (part of) a name, and inside quotes a backslash escapes the next character."""
    names: list[str] = []
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in C_SPACE:
            i += 1
        if i >= n:
            break
        word, quoted = [], False
        while i < n and (quoted or text[i] not in C_SPACE):
            ch = text[i]
            if ch == '"':
                quoted = not quoted
            elif ch == "\\" and quoted:
                i += 1
                escaped = text[i] if i < n else ""
                word.append({"n": "\n", "r": "\r"}.get(escaped, escaped))
            else:
                word.append(ch)  # outside quotes a backslash is itself
            i += 1
        names.append("".join(word))
    return names


# ---- directives -------------------------------------------------------------------------------------

def _read_bytes(data: bytes, path: Path, directives: list[Directive], notes: list[Note], depth: int,
                seen: tuple[str, ...]) -> None:
    for number, line in logical_lines(data, path, notes):
        where = Where(str(path), number)
        if any(_statement(line, word) for word in CONDITIONALS):
            raise ConfError(f"{where}: conditional sections (if/else/endif) are not supported: which branch squid "
                            "takes depends on the running process; flatten the configuration and import that")
        if len(line) >= 9 and _statement(line[:8], "include"):
            _include(include_names(line[8:]), where, path, directives, notes, depth, seen)
            continue
        directive = parse_directive(line, where)
        if _MACRO.search(line):
            notes.append(Note(where, f"{directive.name}: squid expands macros such as ${{process_number}} here; "
                                     "they are read literally", "macro"))
        directives.append(directive)


def _include(patterns: list[str], where: Where, path: Path, directives: list[Directive], notes: list[Note],
             depth: int, seen: tuple[str, ...]) -> None:
    if depth + 1 > MAX_INCLUDE_DEPTH:
        raise ConfError(f"{where}: include nested deeper than {MAX_INCLUDE_DEPTH} levels (squid refuses to start)")
    for pattern in patterns:
        matches = sorted(glob.glob(pattern))
        if not matches and not os.path.isabs(pattern):
            matches = sorted(glob.glob(str(path.parent / pattern)))
            if matches:
                notes.append(Note(where, f"include {pattern}: found next to {path.name}; squid resolves relative "
                                         "paths from its current directory", "include", NOTE))
        if not matches:
            raise ConfError(f"{where}: include {pattern}: no such file (squid refuses to start: 'Unable to find "
                            "configuration file')")
        for match in matches:
            resolved = str(Path(match).resolve())
            if resolved in seen:
                notes.append(Note(where, f"include {match}: includes itself (a cycle); not followed", "include"))
                continue
            _read_file(Path(match), directives, notes, depth + 1, seen, where)


# ---- ACL values -------------------------------------------------------------------------------------

def value_file(token: str) -> str | None:
    """The file an ACL value names: one starting with a quote (``strtokFile``: up to the next quote of
    either kind, or the end of the token), else None."""
    if not token.startswith(('"', "'")):
        return None
    return re.split(r"[\"']", token[1:], maxsplit=1)[0]


def value_file_line(line: str) -> str | None:
    """The one value squid takes from a line of a value file: from its first word to the last word before
    one starting with ``#``, spaces between words included (``strtokFile``); None for a comment or a
    blank line."""
    spans = list(_token_spans(line))  # they stop at the first word starting with '#'
    return line[spans[0][0]:spans[-1][1]] if spans else None


def expand_values(args: list[str], directive: Directive, notes: list[Note]) -> tuple[list[tuple[str, Where]], bool]:
    """ACL values with where each was written: inline, or one per line of a quoted value file. The flag is
    False when a value file could not be read: the ACL's values are then not known."""
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
            data = path.read_bytes()
        except OSError as err:
            notes.append(Note(directive.where, f"value file {name}: cannot be read ({err.strerror or err}); the "
                                               "ACL is treated as undecided (squid reports an error and reads "
                                               "nothing from it)", "value-file", WARNING))
            complete = False
            continue
        for number, piece in enumerate(fgets_pieces(data, VALUE_LINE_BUFFER), 1):
            value = value_file_line(c_string(piece))
            if value is not None:
                out.append((value, Where(str(path), number)))
    return out, complete
