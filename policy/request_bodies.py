"""Which request methods may carry a body, and the one exception a policy may make (``http.body_allowed_on``).

A body on a request whose method gives it no meaning is a smuggling channel: an origin that does not read
it takes its bytes for the next request on the connection, a request egresswall never decided ("CL.0").
GET, HEAD and TRACE bodies are refused whatever the policy says (RFC 9110 9.3.1, 9.3.2: no defined
semantics; 9.3.8: a TRACE must not carry one). DELETE and OPTIONS bodies have no *generally* defined
semantics (9.3.5, 9.3.7) but some APIs give them one, so they are refused by default and an operator whose
origins read them may list the method. The rule itself is applied in ``proxy/http_hygiene.py``; this module
holds the method sets and the parser of the setting, so the loader and the proxy share one definition.
"""

from __future__ import annotations

ALWAYS_REFUSED = frozenset({"GET", "HEAD", "TRACE"})
REFUSED_UNLESS_ALLOWED = frozenset({"DELETE", "OPTIONS"})
SETTING = "http.body_allowed_on"

# Where RFC 9110 says so, for the reasons a human reads.
RFC_SECTION = {"GET": "9.3.1", "HEAD": "9.3.2", "TRACE": "9.3.8", "DELETE": "9.3.5", "OPTIONS": "9.3.7"}

_LISTABLE = " or ".join(sorted(REFUSED_UNLESS_ALLOWED))


def parse_body_method(text: str) -> str:
    """One entry of ``http.body_allowed_on``: exactly ``DELETE`` or ``OPTIONS`` (methods are case-sensitive,
    RFC 9110 9.1). Anything else raises ValueError saying what was found and what may be written."""
    if text in REFUSED_UNLESS_ALLOWED:
        return text
    upper = text.upper()
    if upper in ALWAYS_REFUSED:
        raise ValueError(f"got {text!r}; a {upper} request's body is always refused (RFC 9110 "
                         f"{RFC_SECTION[upper]}: it has no meaning, and an origin that does not read it takes it "
                         f"for another request); only {' and '.join(sorted(REFUSED_UNLESS_ALLOWED))} may be listed")
    if upper in REFUSED_UNLESS_ALLOWED:
        raise ValueError(f"got {text!r}; HTTP methods are case-sensitive: write {upper!r}")
    raise ValueError(f"got {text!r}; expected {_LISTABLE}, the methods whose request body egresswall refuses unless "
                     "they are listed here (a body on POST, PUT, PATCH or any other method is never refused)")
