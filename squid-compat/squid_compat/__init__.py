"""squid compatibility: read and write squid.conf access control, and speak squid's access-log format.

Modules, each one concern: ``conf`` (reading squid.conf byte for byte as squid does: lines, tokens,
continuation lines, ``include``, quoted value files), ``acls`` and ``hostacls`` (squid's ACL types and what
each means for a request), ``acltable`` (the ACLs by name, squid's predefined ones included), ``directives``
(the directive names squid knows), ``posixregex`` (squid's POSIX regexes, where Python's ``re`` reads them
alike), ``program`` (``http_access`` and squid's first-match evaluation), ``space`` (the finite set of
request classes squid's ACLs can tell apart), ``synth`` (egresswall host rules from squid's answers),
``losses`` (where the result refuses more, and why), ``importer`` (squid.conf → egresswall policy, checked),
``emit`` (the policy YAML, with comments), ``addrsets`` (address rules as sets), ``exporter`` (egresswall
policy → squid.conf), and ``access_log`` (squid's native log lines). ``egresswall squid import|export`` is
wired in the command line (``proxy/cli/squid.py``). Only ``policy`` is imported from egresswall.
"""

from .report import Note

__all__ = ["Note"]
