"""squid's access lists (``http_access`` and the lists checked after it) and their evaluation.

squid's rule: the first line whose ACLs all match decides; ACLs on one line are ANDed, ``!`` negates
one; when no line matches, the answer is the opposite of the last line's (deny when there is no line
at all, for ``http_access``). With undecided ACLs (see ``acls``) a line may match or not: evaluation
then keeps both its action and the lines after it as possible outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .acls import Context, Literal, Probe, literal_value, t_and
from .conf import Directive, expand_values
from .report import Note, Where

ALLOW, DENY = "allow", "deny"
OPPOSITE = {ALLOW: DENY, DENY: ALLOW}

# The lists a request must pass, in squid's order, and their answer when they have no line. With no
# adaptation service and no cache, adapted_http_access and miss_access see the same request as
# http_access, so their denials apply too.
ACCESS_LISTS = {"http_access": DENY, "adapted_http_access": ALLOW, "miss_access": ALLOW}
ACCESS_LIST_ALIASES = {"http_access2": "adapted_http_access"}  # squid 5's other name for it
# Stands for the ACL names of a value file that cannot be read (a key no acl line can define: it has spaces).
UNREADABLE_NAMES = Literal("(names from a value file that cannot be read)", undefined=True)


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


def evaluate_list(access: AccessList, probe: Probe, ctx: Context) -> Outcome:
    actions: set[str] = set()
    undecided: list[AccessRule] = []
    for rule in access.rules:
        value = t_and(literal_value(literal, probe, ctx) for literal in rule.literals)
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

    def add(self, directive: Directive, notes: list[Note], defined: Callable[[str], bool]) -> None:
        """One access line. ``defined`` says which ACL keys exist when squid reads it: squid looks each name up
        then, and refuses to start when one is missing."""
        args = list(directive.args)
        if not args or args[0] not in (ALLOW, DENY):
            notes.append(Note(directive.where, f"{directive.text}: expected allow or deny; squid reports an error and "
                                               "skips the line; skipped", "syntax"))
            return
        names, complete = expand_values(args[1:], directive, notes)  # squid reads names from value files too
        literals = [Literal.parse(name, defined) for name, _ in names]
        if not complete:
            # squid stops reading the line at a value file it cannot open, so the line it keeps may match
            # more requests than the one written: the line is undecided.
            literals.append(UNREADABLE_NAMES)
        if not literals:
            notes.append(Note(directive.where, f"{directive.text}: no ACL on the line: squid skips it ('Access line "
                                               "contains no ACL's, skipping'), and so does the import; it does not "
                                               "allow or deny anything, nor count as the last line", "syntax"))
            return
        for literal in literals:
            if literal.undefined and literal is not UNREADABLE_NAMES:
                notes.append(Note(directive.where, f"{directive.text}: acl {literal.written or repr('')} is not "
                                                   "defined before this line (squid refuses to start: 'ACL not "
                                                   "found'); undecided", "syntax"))
        name = ACCESS_LIST_ALIASES.get(directive.name, directive.name)
        self.lists[name].rules.append(AccessRule(name, args[0], tuple(literals), directive.where, directive.text))

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
