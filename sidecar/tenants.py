"""Which tenant a request belongs to (docs/security.md, *Tenants*).

A tenant is its salt. The gateway in front of kvtier names it in the ``X-KVTier-Salt`` header,
and a header that is there names the tenant even when it is empty (the unsalted tenant): the
body's ``cache_salt`` is then ignored, so a client can never move itself into another tenant by
what it writes in its body. Only a request without the header is salted by its body's
``cache_salt`` (vLLM's field): in a deployment without such a gateway, the salt is then a secret
the client holds, and whoever knows it is that tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDictProxy

SALT_HEADER = "X-KVTier-Salt"


def tenant_salt(headers: CIMultiDictProxy[str], body: Mapping[str, Any] | None = None) -> str:
    """The tenant of a request with these ``headers`` and (completions) JSON ``body``.

    Raises:
        ValueError: the header is given more than once (a gateway that adds its own to a
            client's would leave the choice to the order), or ``cache_salt`` is not a string.
    """
    given = headers.getall(SALT_HEADER, [])
    if len(given) > 1:
        raise ValueError(f"{SALT_HEADER} given {len(given)} times: a request belongs to one tenant")
    if given:
        return given[0]
    salt = body.get("cache_salt") if body is not None else None
    if salt is None:
        return ""
    if isinstance(salt, str):
        return salt
    raise ValueError(f"cache_salt must be a string, not {type(salt).__name__}")


def names_tenant(headers: CIMultiDictProxy[str]) -> bool:
    """Whether a gateway named the request's tenant (the header is there, even empty)."""
    return SALT_HEADER in headers


def several_slots(body: Mapping[str, Any]) -> str | None:
    """Why a completion would take more slots than the one kvtier gives it, or None.

    With ``n`` (or ``n_cmpl``) above 1, llama-server computes the prompt on the request's slot and
    copies it into as many other idle slots as it finds, in slot order: another tenant's hot slot,
    or one kvtier has just taken for another request and is restoring into. Neither can be pinned,
    so such requests are refused; a client asks for one completion per request instead. (A list of
    prompts is pinned: llama-server runs each on the request's ``id_slot``, one after the other.)
    """
    for key in ("n", "n_cmpl"):
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 1:
            return (f"{key}: {value} completions at once would run on slots llama-server picks, other "
                    "conversations' among them; ask for one completion per request")
    return None
