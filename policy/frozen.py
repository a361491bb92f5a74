"""Building frozen dataclass instances in bulk.

The ``__init__`` a frozen dataclass is given writes each field through ``object.__setattr__``: about a
microsecond per rule for a three-field pattern, two for a thirteen-field rule. A million-entry allowlist
builds a pattern, an origin and a rule per entry, so those are filled in one dict assignment instead. The
instance is the same as the generated ``__init__`` makes (same fields, equality, hash, repr); only
classes without ``__post_init__`` or ``__slots__`` may be built this way.
"""

from __future__ import annotations

from typing import Any


def instance[T](cls: type[T], values: dict[str, Any]) -> T:
    """``cls(**values)`` for a frozen dataclass, ``values`` holding every field (this dict becomes the instance's)."""
    made = new(cls)
    fill(made, "__dict__", values)
    return made


# The two steps of instance(), for loops that run them a million times without a call of their own.
new = object.__new__
fill = object.__setattr__
