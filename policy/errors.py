"""What is wrong with a policy: each problem names the file, line and column, the key, and what was expected.

The person reading it is an operator mid-edit who wants to fix the line, not read a traceback; and who
wants every problem at once, in file order, not one per attempt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyProblem:
    """One problem. ``str()`` is ``file:line:column: key: message`` (no position when there is none:
    a command-line flag, a file that cannot be read)."""

    source: str
    line: int  # 1-based; 0 when there is no line
    column: int
    key: str  # the dotted key path, e.g. "hosts.allow[3]"; "" for the file as a whole
    message: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}:{self.column}" if self.line else self.source
        return f"{where}: {self.key + ': ' if self.key else ''}{self.message}"


def in_file_order(problems: Iterable[PolicyProblem]) -> tuple[PolicyProblem, ...]:
    """By position; problems without a line (flags, the file as a whole) after those with one, as given."""
    return tuple(sorted(problems, key=lambda p: (p.line == 0, p.line, p.column)))


class PolicyError(ValueError):
    """A policy that cannot be used, with every problem found in it.

    ``problems`` holds them all in file order; ``source``, ``line``, ``column``, ``key`` and ``message``
    are the first one's. ``str()`` is one problem per line; ``summary`` is the first and a count, for a
    log that wants one line.
    """

    def __init__(self, source: str, line: int, column: int, key: str, message: str) -> None:
        self._set((PolicyProblem(source, line, column, key, message),))

    @classmethod
    def of(cls, problems: Iterable[PolicyProblem]) -> PolicyError:
        ordered = in_file_order(problems)
        if not ordered:
            raise ValueError("a PolicyError needs at least one problem")
        err = cls.__new__(cls)
        err._set(ordered)
        return err

    def _set(self, problems: tuple[PolicyProblem, ...]) -> None:
        self.problems = problems
        first = problems[0]
        self.source, self.line, self.column, self.key, self.message = (
            first.source, first.line, first.column, first.key, first.message)
        ValueError.__init__(self, "\n".join(map(str, problems)))

    def __reduce__(self):  # pickles with every problem (the default would call __init__ with one string)
        return type(self).of, (self.problems,)

    @property
    def summary(self) -> str:
        more = len(self.problems) - 1
        return str(self.problems[0]) + (f" (and {more} more error{'s' if more > 1 else ''})" if more else "")
