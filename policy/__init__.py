"""egresswall's pure policy core.

Modules, each one concern: ``addresses`` (IANA classification and address rules), ``hosts`` (the
normaliser), ``patterns`` (host patterns and their index), ``model`` (the loaded policy), ``loader``
(YAML + schema → model), ``decision`` (the verdict), ``lint`` (warnings for operators) and
``resolver`` (the one module that does I/O: DNS). Import what you need from the module itself.
"""
