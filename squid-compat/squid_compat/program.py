"""squid's access lists (``http_access`` and the lists checked after it) and their evaluation.

squid's rule: the first line whose ACLs all match decides; ACLs on one line are ANDed, ``!`` negates
one; when no line matches, the answer is the opposite of the last line's (deny when there is no line
at all, for ``http_access``). With undecided ACLs (see ``acls``) a line may match or not: evaluation
then keeps both its action and the lines after it as possible outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .acls import Context, Probe, Tri, t_and, t_not
from .conf import Directive
from .report import NOTE, Note, Where

ALLOW, DENY = "allow", "deny"
OPPOSITE = {ALLOW: DENY, DENY: ALLOW}

# The lists a request must pass, in squid's order, and their answer when they have no line. With no
# adaptation service and no cache, adapted_http_access and miss_access see the same request as
# http_access, so their denials apply too.
ACCESS_LISTS = {"http_access": DENY, "adapted_http_access": ALLOW, "miss_access": ALLOW}


@dataclass(frozen=True)
class Literal:
    name: str
    negated: bool = False

    def __str__(self) -> str:
        return ("!" if self.negated else "") + self.name


@dataclass(frozen=True)
class AccessRule:
    directive: str
    action: str
    literals: tuple[Literal, ...]
    where: Where
    text: str

    def __str__(self) -> str:
        return f"{self.where} {self.text}"


@dataclass
class AccessList:
    directive: str
    rules: list[AccessRule] = field(default_factory=list)

    @property
    def default(self) -> str:
        return OPPOSITE[self.rules[-1].action] if self.rules else ACCESS_LISTS[self.directive]

    def describe_default(self) -> str:
        if not self.rules:
            return f"{self.directive} with no lines: {self.default}"
        return f"no {self.directive} line matched: {self.default}, the opposite of the last line ({self.rules[-1]})"


@dataclass(frozen=True)
class Outcome:
    actions: frozenset[str]
    decided_by: AccessRule | None  # the first line that certainly matched; None: the implicit default
    undecided: tuple[AccessRule, ...] = ()  # lines passed whose match was undecided

    @property
    def allowed(self) -> bool:
        return self.actions == {ALLOW}


def _literal_value(literal: Literal, probe: Probe, ctx: Context) -> Tri:
    acl = ctx.acls.get(literal.name)
    value = None if acl is None else acl.evaluate(probe, ctx)
    return t_not(value) if literal.negated else value


def evaluate_list(access: AccessList, probe: Probe, ctx: Context) -> Outcome:
    actions: set[str] = set()
    undecided: list[AccessRule] = []
    for rule in access.rules:
        value = t_and(_literal_value(literal, probe, ctx) for literal in rule.literals)
        if value is True:
            actions.add(rule.action)
            return Outcome(frozenset(actions), rule, tuple(undecided))
        if value is None:
            actions.add(rule.action)
            undecided.append(rule)
    actions.add(access.default)
    return Outcome(frozenset(actions), None, tuple(undecided))


@dataclass
class Program:
    """Every access list a request must pass; a request is allowed only when each allows it."""

    lists: dict[str, AccessList] = field(default_factory=lambda: {name: AccessList(name) for name in ACCESS_LISTS})

    def add(self, directive: Directive, notes: list[Note]) -> None:
        args = directive.args
        if not args or args[0] not in (ALLOW, DENY):
            notes.append(Note(directive.where, f"{directive.text}: expected allow or deny (squid would refuse to "
                                               "start); ignored", "syntax"))
            return
        literals = []
        for word in args[1:]:
            negated = word.startswith("!")
            name = word[1:] if negated else word
            if name:
                literals.append(Literal(name, negated))
        if not literals:
            notes.append(Note(directive.where, f"{directive.text}: a line without ACLs matches every request",
                              "syntax", NOTE))
        self.lists[directive.name].rules.append(
            AccessRule(directive.name, args[0], tuple(literals), directive.where, directive.text))

    @property
    def rules(self) -> list[AccessRule]:
        return [rule for access in self.lists.values() for rule in access.rules]

    def evaluate(self, probe: Probe, ctx: Context) -> Outcome:
        """Allowed when every list certainly allows; the rule shown is the one that decided the refusal
        (or, when allowed, the http_access line that allowed)."""
        first: Outcome | None = None
        possible = {ALLOW}
        undecided: list[AccessRule] = []
        for access in self.lists.values():
            if access.directive != "http_access" and not access.rules:
                continue
            outcome = evaluate_list(access, probe, ctx)
            undecided += outcome.undecided
            if first is None:
                first = outcome
            if DENY in outcome.actions:
                possible.add(DENY)
                if ALLOW not in outcome.actions:
                    return Outcome(frozenset({DENY}), outcome.decided_by, tuple(undecided))
        assert first is not None
        return Outcome(frozenset(possible), first.decided_by, tuple(undecided))
