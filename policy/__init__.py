"""egresswall's pure policy core.

Modules, each one concern: ``addresses`` (IANA classification and address rules), ``hosts`` (the
normaliser, default ports, HOST:PORT), ``patterns`` (host patterns and their index), ``model`` (the loaded
policy), ``yamldoc`` (YAML with positions), ``schema`` (the document against schema.json), ``loader`` (text
→ model: the builder), ``errors`` (problems with file:line:column), ``rule_ids`` (stable rule ids),
``decision`` (the verdict), ``lint`` (warnings for operators), ``upstream`` (the upstream proxy's URL, parsed
strictly), ``wire`` (the refusal header names) and
``resolver`` (the one module that does I/O: DNS). Nothing here reads a policy file: the loader takes text
and the name to report it by (``proxy/policy_file.py`` reads files); ``schema`` reads its own package data,
schema.json, once at import. Import what you need from the module itself.
"""
