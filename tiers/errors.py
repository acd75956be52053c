"""The error tree shared by every kvtier package (tiers is the bottom layer, so it lives here)."""

from __future__ import annotations


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class CodecError(KVTierError):
    """A stored blob is damaged, foreign or of an unknown format; it must never be returned."""


class StateFormatError(KVTierError):
    """A llama.cpp sequence-state file (or chunk payload) is malformed or not what it claims."""


class TierUnavailable(KVTierError):
    """A tier cannot be reached right now (the caller treats it as a miss)."""


class ConfigError(KVTierError, ValueError):
    """A setting is wrong or contradicts another one."""
