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

