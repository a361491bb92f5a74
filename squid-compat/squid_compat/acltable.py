"""All ACLs of a squid.conf by name, squid's predefined ones included, built from ``acl`` lines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .acls import (
    Acl,
    DstAcl,
    GroupAcl,
    ManagerAcl,
    MethodAcl,
    OpaqueAcl,
    PortAcl,
    ProtoAcl,
    SrcAcl,
    acl_key,
)
from .conf import Directive, expand_values, take_tokens, tokens
from .hostacls import DomainAcl, DomainRegexAcl
from .report import Note
from .urlregex import UrlRegexAcl

ACL_TYPES: dict[str, type[Acl]] = {
    "src": SrcAcl, "dst": DstAcl, "dstdomain": DomainAcl, "dstdom_regex": DomainRegexAcl, "port": PortAcl,
    "method": MethodAcl, "proto": ProtoAcl, "any-of": GroupAcl, "all-of": GroupAcl, "url_regex": UrlRegexAcl,
}

# The types whose values squid reads as regular expressions (ACLRegexData, RegexStrtokFile): there a
# backslash takes the next character, a space included, into the value.
REGEX_TYPES = frozenset({"url_regex", "urlpath_regex", "dstdom_regex", "srcdom_regex", "browser", "referer_regex",
                         "ssl::server_name_regex", "proxy_auth_regex", "ext_user_regex", "req_mime_type",
                         "rep_mime_type", "peername_regex", "user_cert", "ca_cert", "req_header", "rep_header"})

# squid 5's predefined ACLs (cf.data.pre, "DEFAULT:" lines of the acl directive).
PREDEFINED = (
    "acl all src all",
    "acl manager url_regex -i ^cache_object:// +i ^[^:]+://[^/]+/squid-internal-mgr/",
    "acl localhost src 127.0.0.1/32 ::1",
    "acl to_localhost dst 127.0.0.0/8 0.0.0.0/32 ::1/128 ::/128",
    "acl CONNECT method CONNECT",
)


@dataclass
class AclTable:
    acls: dict[str, Acl] = field(default_factory=dict)  # by acl_key: squid's names are case-insensitive
    method_case_exact: bool = False  # relaxed_header_parser off: squid compares methods as written

    def defines(self, key: str) -> bool:
        return key in self.acls

    def define(self, directive: Directive, notes: list[Note]) -> None:
        words, rest = take_tokens(directive.rest, 2)
        if len(words) < 2:
            notes.append(Note(directive.where, f"{directive.text}: an acl line needs a name and a type "
                                               "(squid would refuse to start); ignored", "syntax"))
            return
        name, type_ = words
        key = acl_key(name)
        defined_before = set(self.acls)  # squid looks names up while it reads the line (an ACL not yet itself)
        flags, rest_values = _split_flags(tokens(rest, regex=type_ in REGEX_TYPES))
        acl = self.acls.get(key)
        if not isinstance(acl, DomainRegexAcl | UrlRegexAcl) and type_ not in ("dstdom_regex", "url_regex"):
            rest_values = [value for value in rest_values if value not in ("-i", "+i")]
        values, complete = expand_values(rest_values, directive, notes)
        if acl is not None and acl.type != type_:
            notes.append(Note(directive.where, f"acl {name} is already defined as {acl.type} at {acl.where}; squid "
                                               f"refuses to start when a name is given another type ({type_}); the "
                                               "ACL is undecided", "syntax"))
            acl.undecided_because = "defined with two types"
            return
        is_new = acl is None
        if acl is None:
            acl = self._new(key, name, type_, directive)
        elif isinstance(acl, ManagerAcl):
            acl = self._replace_manager(acl, type_)
        acl.wheres.append(directive.where)
        if not complete:
            acl.undecided_because = "a value file could not be read"
        if isinstance(acl, GroupAcl):
            acl.defined = defined_before.__contains__ if is_new else self.defines
        if isinstance(acl, MethodAcl):
            acl.case_exact = self.method_case_exact
        acl.add(flags, values, notes)

    def _new(self, key: str, name: str, type_: str, directive: Directive) -> Acl:
        if key == "manager" and type_ == "url_regex" and directive.where.file == "squid built-in":
            acl: Acl = ManagerAcl(name, type_)
        else:
            acl = ACL_TYPES.get(type_, OpaqueAcl)(name, type_)
            if isinstance(acl, OpaqueAcl):
                acl.undecided_because = f"the acl type {type_} has no egresswall equivalent"
        self.acls[key] = acl
        return acl

    def _replace_manager(self, manager: ManagerAcl, type_: str) -> Acl:
        replacement = OpaqueAcl(manager.name, type_)
        replacement.wheres = manager.wheres
        replacement.undecided_because = "squid's manager ACL with values added"
        self.acls[acl_key(manager.name)] = replacement
        return replacement


def _split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """Leading options (-n, -m[=...], ``--``). ``-i``/``+i`` stay among the values: the regex types
    read them in place (they switch case-insensitivity for the values after them)."""
    flags: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--":
            i += 1
            break
        if re.fullmatch(r"-n|-m(=.*)?", args[i]):
            flags.append(args[i])
            i += 1
            continue
        break
    rest = args[i:]
    return flags, rest
