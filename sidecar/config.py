"""Settings of ``kvtier serve``: defaults < YAML file < ``KVTIER_*`` env vars < flags.

A wrong or contradictory option stops start-up with one clear line (``ConfigError``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import yaml

from tiers.base import parse_size
from tiers.codec import COMPRESSIONS
from tiers.errors import ConfigError
from tiers.redis_urls import parse_redis_url

# name: (default, help). Sizes in bytes accept 512M / 2G; durations in seconds.
DEFAULTS: dict[str, tuple[Any, str]] = {
    "listen": ("0.0.0.0:8081", "HOST:PORT the sidecar listens on"),
    "llama_url": ("http://127.0.0.1:8080", "llama-server base URL"),
    "slot_dir": (None, "directory llama-server was given as --slot-save-path (required)"),
    "redis_url": (None, "redis:// rediss:// unix:// redis+sentinel:// redis+cluster:// (optional)"),
    "redis_username": (None, "Redis ACL user (overrides the URL's)"),
    "redis_password": (None, "Redis password (overrides the URL's; prefer the env var or a file)"),
    "redis_password_file": (None, "file holding the Redis password"),
    "cache_size": ("2G", "RAM tier budget"),
    "eviction": ("s3fifo", "RAM tier eviction policy: s3fifo or lru"),
    "shared_dir": (None, "node-local shared tier directory (e.g. /dev/shm/kvtier); off when unset"),
    "shared_size": ("4G", "shared tier budget"),
    "chunk_tokens": (256, "tokens per prefix chunk"),
    "compress": ("adaptive", "adaptive, lz4, zstd or none"),
    "ttl": (86400, "seconds a chunk lives in Redis after its last hit (0 = no expiry)"),
    "node_id": (None, "name of this node in events and metrics (default: hostname)"),
    "model": (None, "path of the GGUF llama-server serves, to fingerprint it (default: from /props)"),
    "model_id": (None, "explicit model identity instead of hashing the GGUF"),
    "local_tokenizer": ("auto", "auto: render chats and tokenize prompts in kvtier where it can (tokenizing needs "
                                "llama-cpp-python and the model file), checked against llama-server; off: ask it"),
    "log_format": ("text", "text or json"),
    "auth_token": (None, "bearer token for the sessions and admin API"),
    "auth_token_file": (None, "file holding the bearer token"),
    "auth_all": (False, "require the token on every endpoint, not only sessions/admin"),
    "max_body": ("32M", "largest request body accepted"),
    "queue_limit": (32, "pending background Redis write jobs (one per saved slot) before the oldest is dropped"),
    "restore_min_tokens": (0, "never restore fewer tokens than this (0 = cost model decides)"),
    "prefill_tps_prior": (300.0, "prior prefill rate (tokens/s) before one is measured"),
    "restore_gbps_prior": (0.5, "prior restore bandwidth (GB/s) before one is measured"),
    "prewarm": (False, "prefetch chunks announced by other nodes into the local tiers"),
    "shutdown_timeout": (20.0, "seconds to drain requests and writes on SIGTERM"),
    "keep_restore_files": ("1G", "bytes of restore files (one per slot) kept in the slot dir and overwritten in "
                                 "place by the next restore: no new pages to allocate (0 = remove each after use)"),
}
SECRETS = ("redis_password", "auth_token")


@dataclass(frozen=True, slots=True)
class Settings:
    listen: str = "0.0.0.0:8081"
    llama_url: str = "http://127.0.0.1:8080"
    slot_dir: str | None = None
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    redis_username: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    redis_password_file: str | None = None
    cache_size: int = 2 << 30
    eviction: str = "s3fifo"
    shared_dir: str | None = None
    shared_size: int = 4 << 30
    chunk_tokens: int = 256
    compress: str = "adaptive"
    ttl: int = 86400
    node_id: str = ""
    model: str | None = None
    model_id: str | None = None
    local_tokenizer: str = "auto"
    log_format: str = "text"
    auth_token: str | None = field(default=None, repr=False)
    auth_token_file: str | None = None
    auth_all: bool = False
    max_body: int = 32 << 20
    queue_limit: int = 32
    restore_min_tokens: int = 0
    prefill_tps_prior: float = 300.0
    restore_gbps_prior: float = 0.5
    prewarm: bool = False
    shutdown_timeout: float = 20.0
    keep_restore_files: int = 1 << 30

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)

    def redacted(self) -> dict[str, Any]:
        """The effective settings with secrets hidden (for the start-up log)."""
        out = dataclasses.asdict(self)
        for key in SECRETS:
            if out.get(key):
                out[key] = "***"
        if out.get("redis_url"):
            out["redis_url"] = redact_url(out["redis_url"])
        return out


def redact_url(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host``."""
    return re.sub(r"(//[^/@:]*:)[^@/]*@", r"\1***@", url)


_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _coerce(name: str, value: Any) -> Any:
    default = DEFAULTS[name][0]
    kind = type(default) if default is not None else str
    if value is None:
        return None
    if name in ("cache_size", "shared_size", "max_body", "keep_restore_files"):
        return parse_size(value if isinstance(value, (int, str)) else str(value), name=name)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _BOOL:
            return _BOOL[str(value).lower()]
        raise ConfigError(f"{name}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            return int(str(value), 10)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name}: expected a string, got {type(value).__name__}")
    return str(value)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``ConfigError`` line instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvtier serve", description="KV-cache sidecar in front of llama-server")
    p.add_argument("--config", help="YAML file with any of the settings below (keys with _ or -)")
    for name, (default, help_text) in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=help_text)
        else:
            p.add_argument(flag, dest=name, default=None, help=f"{help_text} (default: {default})")
    return p


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge defaults, the YAML file, ``KVTIER_*`` env vars and flags; validate the result."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    merged: dict[str, Any] = {name: default for name, (default, _) in DEFAULTS.items()}
    config_path = args.config or env.get("KVTIER_CONFIG")
    if config_path:
        merged.update(_read_yaml(config_path))
    for name in DEFAULTS:
        value = env.get("KVTIER_" + name.upper())
        if value is not None and value != "":
            merged[name] = value
    for name in DEFAULTS:
        value = getattr(args, name)
        if value is not None:
            merged[name] = value
    values = {name: _coerce(name, value) for name, value in merged.items()}
    values["redis_password"] = _secret(values, "redis_password", "redis_password_file")
    values["auth_token"] = _secret(values, "auth_token", "auth_token_file")
    if not values.get("node_id"):
        values["node_id"] = socket.gethostname()
    settings = Settings(**{f.name: values[f.name] for f in fields(Settings) if f.name in values})
    validate(settings)
    return settings


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in DEFAULTS:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        out[name] = value
    return out


def _secret(values: dict[str, Any], name: str, file_name: str) -> str | None:
    path = values.get(file_name)
    if path:
        if values.get(name):
            raise ConfigError(f"give either {name} or {file_name}, not both")
        try:
            secret = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read {file_name} {path}: {exc.strerror}") from None
        if not secret:
            raise ConfigError(f"{file_name} {path} is empty")
        return secret
    value = values.get(name)
    return str(value) if value else None


def validate(s: Settings) -> None:
    host, _, port = s.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen: expected HOST:PORT, got {s.listen!r}")
    url = urlsplit(s.llama_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"llama_url: expected http(s)://host:port, got {s.llama_url!r}")
    if not s.slot_dir:
        raise ConfigError("slot_dir is required: the directory llama-server was given as --slot-save-path")
    if s.redis_url is not None:
        parse_redis_url(s.redis_url)  # the tier's own parser: one definition of what a Redis URL may be
    if s.cache_size <= 0:
        raise ConfigError("cache_size must be positive")
    if s.shared_dir is not None and s.shared_size <= 0:
        raise ConfigError("shared_size must be positive when shared_dir is set")
    if not 16 <= s.chunk_tokens <= 65536:
        raise ConfigError(f"chunk_tokens must be in 16..65536, got {s.chunk_tokens}")
    if s.compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {s.compress!r}")
    if s.ttl < 0:
        raise ConfigError(f"ttl must not be negative, got {s.ttl}")
    if s.eviction not in ("s3fifo", "lru"):
        raise ConfigError(f"eviction must be s3fifo or lru, got {s.eviction!r}")
    if s.local_tokenizer not in ("auto", "off"):
        raise ConfigError(f"local_tokenizer must be auto or off, got {s.local_tokenizer!r}")
    if s.log_format not in ("text", "json"):
        raise ConfigError(f"log_format must be text or json, got {s.log_format!r}")
    if s.auth_all and not s.auth_token:
        raise ConfigError("auth_all needs auth_token or auth_token_file")
    if s.max_body < 1024:
        raise ConfigError("max_body must be at least 1K")
    if s.queue_limit <= 0:
        raise ConfigError("queue_limit must be positive")
    if s.restore_min_tokens < 0:
        raise ConfigError("restore_min_tokens must not be negative")
    if s.prefill_tps_prior <= 0 or s.restore_gbps_prior <= 0:
        raise ConfigError("cost-model priors must be positive")
    if s.prewarm and not s.redis_url:
        raise ConfigError("prewarm needs redis_url (events come through Redis pub/sub)")
    if s.shutdown_timeout < 0:
        raise ConfigError("shutdown_timeout must not be negative")
    if s.node_id and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", s.node_id):
        raise ConfigError(f"node_id may hold letters, digits, '.', '_' and '-' (1-128), got {s.node_id!r}")
