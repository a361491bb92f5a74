"""The ACL types that look at the request's host name: ``dstdomain`` and ``dstdom_regex``.

Their values are also the *anchors* that cut the host space into regions (see ``space``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass

from policy.hosts import HostFormError
from policy.patterns import PatternKind, normalise_pattern_host

from .acls import EXACT, IP_ANY, Acl, Context, HostRef, Probe, Tri, ip_text, parse_ip, t_or
from .conf import ConfError
from .overlaps import DomainOverlapFatal, DomainTree
from .posixregex import compile_like_squid, needs_char_outside, parse, sre_constants
from .report import NOTE, Note, Where, printable


@dataclass(frozen=True)
class Anchor:
    """A name the host space is cut at: every dstdomain value and every host pattern a regex maps to."""

    name: str
    ip: bool = False


@dataclass
class DomainValue:
    kind: PatternKind  # EXACT or DOMAIN (squid's leading dot)
    name: str
    where: Where
    undecided: bool = False  # written with a trailing dot: squid never matches it; the intent is unclear


class DomainAcl(Acl):
    """``dstdomain``: indexed by name, so a list of many thousand domains costs one lookup per label.

    squid never keeps two overlapping values (``overlaps``): a value
    below one listed before it is ignored (``.a.test www.a.test``: nothing lost), and one that would hide a value
    listed before it (``www.a.test .a.test``, ``a.test .a.test``, ``.a.test a.test``) makes squid refuse to
    start. Values are inserted as squid inserts them, and only those it keeps count."""

    host_dependent = True

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.values: list[DomainValue] = []
        self._exact: dict[str, list[DomainValue]] = {}
        self._domain: dict[str, list[DomainValue]] = {}
        self.ips: set[str] = set()
        self.no_lookup = False
        self.none_listed = False  # squid names a failed reverse lookup "none"
        self._tree = DomainTree()

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.no_lookup = self.no_lookup or "-n" in flags
        for raw, where in values:
            if self._kept_by_squid(raw, where, notes):
                self._add_value(raw, where, notes)

    def _kept_by_squid(self, raw: str, where: Where, notes: list[Note]) -> bool:
        """Whether squid keeps the value in the ACL; ConfError when squid refuses to start on it."""
        text = _ascii_lower(raw.encode("utf-8", "surrogateescape"))  # squid's Tolower(): C locale
        try:
            inserted = self._tree.insert(text)
        except DomainOverlapFatal as err:
            longer, shorter = sorted((err.kept, err.new), key=len, reverse=True)
            raise ConfError(f"{where}: acl {printable(self.name)} dstdomain {printable(raw)}: squid refuses to start "
                            f"(\"ERROR: '{_text(longer)}' is a subdomain of '{_text(shorter)}'\"): this value would "
                            f"hide {_text(err.kept)}, listed before it in the same ACL; remove one of them") from None
        if not inserted.kept and inserted.covered_by is not None:
            notes.append(Note(where, f"acl {self.name} dstdomain {raw}: squid ignores it, as "
                                     f"{_text(inserted.covered_by)} listed before it in this ACL already matches "
                                     "every name it does; nothing is lost", "overlap", NOTE))
        return inserted.kept

    def _add_value(self, raw: str, where: Where, notes: list[Note]) -> None:
        text = raw.lower()
        if text == "none":
            self.none_listed = True
            return
        if text.startswith("[") and text.endswith("]"):
            try:
                self.ips.add(ip_text(parse_ip(text[1:-1], unwrap=True, dotted_ipv6=True)))
            except ValueError:
                notes.append(Note(where, f"acl {self.name} dstdomain {raw}: not an IPv6 address; it never matches",
                                  "never-matches", NOTE))
            return
        if ":" in text:
            notes.append(Note(where, f"acl {self.name} dstdomain {raw}: squid compares IPv6 URL hosts in brackets "
                                     f"([{raw}]), so this value never matches; translated as never matching",
                              "never-matches"))
            return
        undecided = text.endswith(".") and not text.endswith("..")
        if undecided:
            text = text[:-1]
            notes.append(Note(where, f"acl {self.name} dstdomain {raw}: squid strips the trailing dot from request "
                                     "hosts but not from ACL values, so squid never matches this value; where it "
                                     f"would decide, egresswall refuses (undecided: did you mean {text}?)",
                              "trailing-dot"))
        kind = PatternKind.DOMAIN if text.startswith(".") else PatternKind.EXACT
        body = text[1:] if kind is PatternKind.DOMAIN else text
        if not raw.isascii():
            notes.append(Note(where, f"acl {self.name} dstdomain {raw}: squid compares it byte for byte with the "
                                     "A-label (xn--) host clients send, so it never matches; translated as never "
                                     "matching", "never-matches"))
            return
        try:
            name, ip = normalise_pattern_host(body)
        except HostFormError as err:
            notes.append(Note(where, f"acl {self.name} dstdomain {raw}: no host egresswall accepts can match it "
                                     f"({err.reason}); translated as never matching", "never-matches", NOTE))
            return
        if ip is not None:
            if kind is PatternKind.DOMAIN:
                notes.append(Note(where, f"acl {self.name} dstdomain {raw}: a leading dot before an address "
                                         "matches nothing but the address", "never-matches", NOTE))
            self.ips.add(name)
            return
        value = DomainValue(kind, name, where, undecided)
        self.values.append(value)
        (self._domain if kind is PatternKind.DOMAIN else self._exact).setdefault(name, []).append(value)

    def anchors(self) -> Iterable[Anchor]:
        for value in self.values:
            yield Anchor(value.name)
        for ip in self.ips:
            yield Anchor(ip, ip=True)

    def matching(self, host: str) -> list[DomainValue]:
        found = list(self._exact.get(host, ())) + list(self._domain.get(host, ()))
        suffix = host
        while (dot := suffix.find(".")) != -1:
            suffix = suffix[dot + 1:]
            found += self._domain.get(suffix, ())
        return found

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        host = probe.host
        if host.region == IP_ANY or host.ip is not None:
            if host.ip is not None and host.name in self.ips:
                return True
            # squid would try the reverse (PTR) name of the address; egresswall never trusts one. A
            # failed lookup is called "none" by squid: listed, the ACL is undecided for IP literals.
            return None if self.none_listed and not self.no_lookup else False
        found = self.matching(host.name)
        if any(not value.undecided for value in found):
            return True
        return None if found else False


def _ascii_lower(text: bytes) -> bytes:
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = bytes.maketrans(string.ascii_uppercase.encode(), string.ascii_lowercase.encode())


def _text(value: bytes) -> str:
    return printable(value.decode("utf-8", "surrogateescape"))


@dataclass
class RegexValue:
    pattern: str
    icase: bool
    where: Where
    compiled: re.Pattern[str] | None
    mapped: tuple[PatternKind, str] | None = None  # equivalent host pattern
    confined: str | None = None  # the regex can only match names below this one
    never: bool = False


_LITERAL = r"(?:[A-Za-z0-9-]|\\\.)+"
_DOMAIN = re.compile(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*")
# Every character of a host name egresswall decides, as squid sees it (IPv6 literals in brackets).
HOST_CHARS = frozenset(string.ascii_letters + string.digits + ".-_:[]")
_DOMAIN_PREFIXES = (r"(.*\.)?", r"(.+\.)?", r"([^.]+\.)*", r"([a-z0-9-]+\.)*", r"([-a-z0-9]+\.)*",
                    r"([a-z0-9-]*\.)*", r"(.*\.|)", r"(|.*\.)", r"(.*\.)*")
_SUBDOMAIN_PREFIXES = (r".*\.", r".+\.", r"(.*\.)+", r"(.+\.)+", r"([^.]+\.)+", r"([a-z0-9-]+\.)+")


def analyse_regex(pattern: str, icase: bool) -> tuple[tuple[PatternKind, str] | None, str | None, bool]:
    """(mapped host pattern, confining suffix, never matches) for a dstdom_regex value squid and Python
    read alike (see ``posixregex``; any other is undecided for every host).

    Simple anchored regexes are host patterns: ``^example\\.com$`` is example.com, ``^(.*\\.)?example\\.com$``
    and ``(^|\\.)example\\.com$`` are .example.com, ``\\.example\\.com$`` is *.example.com. Otherwise a
    regex whose every match ends in a literal ``.name`` can only match hosts below name ("confined"):
    undecided there, and known not to match elsewhere. A regex that needs a character no host name has
    never matches one egresswall decides.
    """
    items = parse(pattern, icase)
    if items is None:
        return None, None, False
    if needs_char_outside(items, HOST_CHARS):
        return None, None, True
    mapped = _host_pattern(pattern)
    if mapped is not None:
        kind, name = mapped
        if not icase and name != name.lower():
            return None, None, True  # squid lower-cases hosts: an upper-case literal never matches
        return (kind, name.lower()), None, False
    suffix = _confining_suffix(items)
    if suffix is not None and not icase and suffix != suffix.lower():
        return None, None, True
    return None, suffix and suffix.lower(), False


def _host_pattern(pattern: str) -> tuple[PatternKind, str] | None:
    """The host pattern a regex of one of the simple anchored forms is, else None."""
    if not pattern.endswith("$") or pattern.endswith("\\$"):
        return None
    body = pattern[:-1]
    anchored = body.startswith("^")
    if anchored:
        body = body[1:]
    kind, rest = None, None
    if not anchored and body.startswith("(^|\\.)"):
        kind, rest = PatternKind.DOMAIN, body[len("(^|\\.)"):]
    elif anchored:
        kind, rest = _anchored_form(body)
    elif body.startswith("\\.") and re.fullmatch(_LITERAL, body[2:]):
        kind, rest = PatternKind.SUBDOMAINS, body[2:]
    if kind is not None and rest and re.fullmatch(_LITERAL, rest):
        return kind, rest.replace("\\.", ".")
    return None


def _anchored_form(body: str) -> tuple[PatternKind, str]:
    for prefix in _DOMAIN_PREFIXES:
        if body.startswith(prefix):
            return PatternKind.DOMAIN, body[len(prefix):]
    for prefix in _SUBDOMAIN_PREFIXES:
        if body.startswith(prefix):
            return PatternKind.SUBDOMAINS, body[len(prefix):]
    return PatternKind.EXACT, body


def _confining_suffix(items: list) -> str | None:
    """``name`` when every match ends the host with ``.name``: the parse tree (no alternation at the top,
    which the parser would have made its only item) ends in literal characters and ``$``."""
    if len(items) < 2 or items[-1] != (sre_constants.AT, sre_constants.AT_END):
        return None
    tail = []
    for op, arg in reversed(items[:-1]):
        if op != sre_constants.LITERAL:
            break
        tail.append(chr(arg))
    literal = "".join(reversed(tail))
    if "." not in literal:
        return None
    name = literal.split(".", 1)[1]
    return name if _DOMAIN.fullmatch(name) else None


class DomainRegexAcl(Acl):
    """``dstdom_regex``: host patterns where the regex is one, confined or undecided otherwise."""

    host_dependent = True

    def __init__(self, name: str, type_: str) -> None:
        super().__init__(name, type_)
        self.values: list[RegexValue] = []
        self.no_lookup = False

    def add(self, flags: list[str], values: list[tuple[str, Where]], notes: list[Note]) -> None:
        self.no_lookup = self.no_lookup or "-n" in flags
        icase = False
        for raw, where in values:
            if raw == "-i":
                icase = True
                continue
            if raw == "+i":
                icase = False
                continue
            compiled, why = compile_like_squid(raw, icase)
            mapped, confined, never = analyse_regex(raw, icase) if compiled is not None else (None, None, False)
            self.values.append(RegexValue(raw, icase, where, compiled, mapped, confined, never))
            if compiled is None:
                notes.append(Note(where, f"acl {self.name} dstdom_regex {raw}: {why}; undecided for every host",
                                  "regex"))
            elif never:
                notes.append(Note(where, f"acl {self.name} dstdom_regex {raw}: squid matches lower-case host names "
                                         "as clients wrote them; this regex needs an upper-case letter (add -i?) or "
                                         "a character no host name egresswall decides has (egresswall decides the "
                                         "A-label of a Unicode name), so it never matches", "never-matches"))
            elif mapped is None:
                scope = f"hosts below {confined}" if confined else "every host"
                notes.append(Note(where, f"acl {self.name} dstdom_regex {raw}: not a host pattern egresswall can "
                                         f"express; undecided for {scope} (write it as ^(.*\\.)?name$, ^name$ or "
                                         "\\.name$ to translate it exactly)", "regex"))

    def anchors(self) -> Iterable[Anchor]:
        for value in self.values:
            if value.mapped is not None:
                yield Anchor(value.mapped[1])
            elif value.confined is not None:
                yield Anchor(value.confined)

    def _value(self, value: RegexValue, host: HostRef) -> Tri:
        if value.never:
            return False
        if value.compiled is None:
            return None
        if host.region == EXACT:
            return bool(value.compiled.search(host.squid_text))
        if host.region == IP_ANY:
            if value.mapped is not None:
                return False
            if value.confined is not None and not value.confined.rsplit(".", 1)[-1].isdigit():
                return False
            return None
        if value.mapped is not None:
            kind, name = value.mapped
            below = host.name.endswith("." + name)
            if kind is PatternKind.EXACT:
                return host.name == name
            if kind is PatternKind.SUBDOMAINS:
                return below
            return below or host.name == name
        if value.confined is not None:
            return None if host.name.endswith("." + value.confined) else False
        return None

    def _evaluate(self, probe: Probe, ctx: Context) -> Tri:
        return t_or(self._value(value, probe.host) for value in self.values)
