"""Header names kvtier reads or writes, and the one hop-by-hop set every relay leaves out."""

from __future__ import annotations

from collections.abc import Iterable

# Headers about one connection, not the message (RFC 9110 7.6.1), plus those the relay writes
# itself (Host, Content-Length) and Expect (answered by the sidecar's own server): never passed on,
# to llama-server, to a peer, or back to a client.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", "expect",
})
KVTIER_PREFIX = "x-kvtier-"  # kvtier's own request headers (lower case): never reach llama-server

REQUEST_ID = "X-Request-Id"  # one id per request, in every log line and on the answer
SESSION_ID = "X-Session-Id"  # restore and save this session around the completion
FORWARDED = "X-KVTier-Forwarded"  # set on a forwarded request: the node that forwarded it
FORWARDED_TO = "X-KVTier-Forwarded-To"  # set on the answer: the node that served it
# On a completion's answer: what kvtier did for it.
SLOT = "X-KVTier-Slot"
RESTORED_TOKENS = "X-KVTier-Restored-Tokens"
RESTORE_TIER = "X-KVTier-Restore-Tier"
PROMPT_TOKENS = "X-KVTier-Prompt-Tokens"
SLOT_CACHED_TOKENS = "X-KVTier-Slot-Cached-Tokens"


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` without the hop-by-hop ones: what a relay passes on."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def for_llama_server(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A client's headers as llama-server gets them: end to end, and none of kvtier's own."""
    return [(k, v) for k, v in headers
            if (low := k.lower()) not in HOP_BY_HOP and not low.startswith(KVTIER_PREFIX)]
