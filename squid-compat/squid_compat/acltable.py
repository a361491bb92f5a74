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
)
from .conf import Directive, expand_values
from .hostacls import DomainAcl, DomainRegexAcl
from .report import Note
from .urlregex import UrlRegexAcl

ACL_TYPES: dict[str, type[Acl]] = {
    "src": SrcAcl, "dst": DstAcl, "dstdomain": DomainAcl, "dstdom_regex": DomainRegexAcl, "port": PortAcl,
    "method": MethodAcl, "proto": ProtoAcl, "any-of": GroupAcl, "all-of": GroupAcl, "url_regex": UrlRegexAcl,
}

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
    acls: dict[str, Acl] = field(default_factory=dict)

    def define(self, directive: Directive, notes: list[Note]) -> None:
        args = list(directive.args)
        if len(args) < 2:
            notes.append(Note(directive.where, f"{directive.text}: an acl line needs a name and a type "
                                               "(squid would refuse to start); ignored", "syntax"))
            return
        name, type_ = args[0], args[1]
        flags, rest = _split_flags(args[2:])
        if not isinstance(self.acls.get(name), DomainRegexAcl | UrlRegexAcl) and type_ not in ("dstdom_regex",
                                                                                          "url_regex"):
            rest = [value for value in rest if value not in ("-i", "+i")]
        values, complete = expand_values(rest, directive, notes)
        acl = self.acls.get(name)
        if acl is not None and acl.type != type_:
            notes.append(Note(directive.where, f"acl {name} is already defined as {acl.type} at {acl.where}; squid "
                                               f"refuses to start when a name is given another type ({type_}); the "
                                               "ACL is undecided", "syntax"))
            acl.undecided_because = "defined with two types"
            return
        if acl is None:
            if name == "manager" and type_ == "url_regex" and directive.where.file == "squid built-in":
                acl = ManagerAcl(name, type_)
            else:
                acl = ACL_TYPES.get(type_, OpaqueAcl)(name, type_)
                if isinstance(acl, OpaqueAcl):
                    acl.undecided_because = f"the acl type {type_} has no egresswall equivalent"
            self.acls[name] = acl
        elif isinstance(acl, ManagerAcl):
            replacement = OpaqueAcl(name, type_)
            replacement.wheres = acl.wheres
            replacement.undecided_because = "squid's manager ACL with values added"
            self.acls[name] = acl = replacement
        acl.wheres.append(directive.where)
        if not complete:
            acl.undecided_because = "a value file could not be read"
        acl.add(flags, values, notes)


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
