"""Why a request body was refused, in the same words on both transports (the fast path and mitmproxy's)."""

from __future__ import annotations


def body_over_limit_reason(limit: int) -> str:
    """Why a chunked body was refused 413 (both transports: the same words in the same record). A chunked
    body counts as sent — chunk size lines, extensions, line ends and data — so a client cannot stream
    bytes without end through chunk extensions that carry no data."""
    return (f"the request body is over the limit of {limit} bytes (limits.max_request_body; a chunked body counts "
            "as sent: chunk size lines, chunk extensions and line ends as well as its data)")


def body_line_too_long_reason(limit: int) -> str:
    """Why a chunked body was refused 400 ``http:bad-chunked`` for a line that did not end (both
    transports): a chunk size line with its extensions, or a trailer, is bounded as a head is."""
    return (f"egresswall: a line of the chunked request body (a chunk size with its extensions, or a trailer) is "
            f"over {limit} bytes (limits.max_header_bytes) and has not ended")


# Trailer fields would reach the origin after the body, past every check of the head: neither path
# forwards them (mitmproxy's reader cannot: it raises on them).
TRAILERS_REASON = "the chunked request body ends with trailer fields; egresswall does not forward trailers"


def body_unparseable_reason(error: str) -> str:
    """Why a chunked body was refused 400 ``http:bad-chunked`` for a framing h11's chunk reader refused (a
    negative or ``0x`` size, data not followed by its line end): h11's own words, on both transports."""
    return "egresswall: " + f"the request body cannot be parsed: {error}"[:300]
