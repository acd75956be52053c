"""Settings of ``kvtier serve``: defaults < YAML file < ``KVTIER_*`` env vars < flags.

Each setting is declared once, as a field of ``Settings``: its default, its help text and how a
given value is parsed. Its flag (``--cache-size``), env var (``KVTIER_CACHE_SIZE``) and YAML key
(``cache_size`` or ``cache-size``) follow from its name. A wrong or contradictory option stops
start-up with one clear line (``ConfigError``).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import yaml

from tiers.base import parse_size
from tiers.codec import COMPRESSIONS, MIN_MAC_KEY_BYTES
from tiers.errors import ConfigError
from tiers.redis_urls import parse_redis_url, redacted_url

from .peerurl import parse_peer_url

Parse = Callable[[str, Any], Any]  # (setting name, value as given) -> typed value; raises ConfigError


def _text(name: str, value: Any) -> str:
    # YAML gives numbers and booleans for bare words (8081, off); they are taken as written.
    if not isinstance(value, (str, int, float)):
        raise ConfigError(f"{name}: expected a string, got {type(value).__name__}")
    return str(value)


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    try:
        return int(str(value), 10)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def _float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in _BOOL_WORDS:
        return _BOOL_WORDS[str(value).lower()]
    raise ConfigError(f"{name}: expected true/false, got {value!r}")


def _size(name: str, value: Any) -> int:
    """Bytes; ``512M`` and ``2G`` accepted (binary units)."""
    return parse_size(value if isinstance(value, (int, str)) else str(value), name=name)


def _hidden(value: Any) -> str:
    return "***"


@dataclass(frozen=True, slots=True)
class Option:
    """The part of a setting's declaration that is not its name, type and default."""

    help: str
    parse: Parse = _text
    redact: Callable[[Any], Any] | None = None  # what the start-up log shows instead of a set value

    def shown_default(self, default: Any) -> str | None:
        """The default as a user would write it (``2G`` rather than 2147483648); None when unset."""
        if default is None or default == "":
            return None
        if self.parse is _size:
            for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
                if default and default % (1 << shift) == 0:
                    return f"{default >> shift}{unit}"
        return str(default)


def _option(default: Any, help: str, parse: Parse = _text, redact: Callable[[Any], Any] | None = None) -> Any:
    return field(default=default, repr=redact is None, metadata={"option": Option(help, parse, redact)})


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of ``kvtier serve``. Sizes are bytes (``512M``/``2G`` accepted), durations seconds."""

    listen: str = _option("0.0.0.0:8081", "HOST:PORT the sidecar listens on")
    llama_url: str = _option("http://127.0.0.1:8080", "llama-server base URL")
    llama_socket: str | None = _option(None, "Unix socket llama-server listens on (its --host PATH.sock): kvtier "
                                             "connects there, and llama_url names only the Host header and a path "
                                             "prefix")
    slot_dir: str | None = _option(None, "directory llama-server was given as --slot-save-path (required)")
    redis_url: str | None = _option(None, "redis:// rediss:// unix:// redis+sentinel:// redis+cluster:// (optional)",
                                    redact=redacted_url)  # may hold passwords
    redis_username: str | None = _option(None, "Redis ACL user (overrides the URL's)")
    redis_password: str | None = _option(None, "Redis password (overrides the URL's; prefer the env var or a file)",
                                         redact=_hidden)
    redis_password_file: str | None = _option(None, "file holding the Redis password")
    cache_size: int = _option(2 << 30, "RAM tier budget", _size)
    eviction: str = _option("s3fifo", "RAM tier eviction policy: s3fifo or lru")
    shared_dir: str | None = _option(None, "node-local shared tier directory (e.g. /dev/shm/kvtier); off when unset")
    shared_size: int = _option(4 << 30, "shared tier budget", _size)
    chunk_tokens: int = _option(256, "tokens per prefix chunk", _int)
    stream_window: int = _option(64 << 20, "bytes a large save or restore moves at a time: one window is sent or "
                                           "written while the next is cut or fetched", _size)
    compress: str = _option("adaptive", "adaptive, lz4, zstd or none")
    ttl: int = _option(86400, "seconds a chunk lives in Redis after its last hit (0 = no expiry)", _int)
    chunk_key: str | None = _option(None, "secret shared by every node (16+ characters): stored values carry a keyed "
                                          "MAC and values without a valid one are dropped (prefer the env var or a "
                                          "file)", redact=_hidden)
    chunk_key_file: str | None = _option(None, "file holding the chunk MAC secret")
    node_id: str = _option("", "name of this node in events and metrics (default: hostname)")
    model: str | None = _option(None, "path of the GGUF llama-server serves, to fingerprint it (default: from /props)")
    model_id: str | None = _option(None, "explicit model identity instead of hashing the GGUF")
    local_tokenizer: str = _option("auto", "auto: render chats and tokenize prompts in kvtier where it can "
                                           "(tokenizing needs llama-cpp-python and the model file), checked against "
                                           "llama-server; off: ask it")
    log_format: str = _option("text", "text or json")
    auth_token: str | None = _option(None, "bearer token for the sessions and admin API", redact=_hidden)
    auth_token_file: str | None = _option(None, "file holding the bearer token")
    auth_all: bool = _option(False, "require the token on every endpoint, not only sessions/admin", _bool)
    max_body: int = _option(32 << 20, "largest request body accepted", _size)
    body_timeout: float = _option(60.0, "seconds a client has to send a request body; slower ones get 408", _float)
    max_prompt_chars: int = _option(0, "longest prompt text (characters) a completion may carry, checked before it "
                                       "is tokenized; longer ones get 400 (0 = the slots' context size x 32)", _int)
    max_json_values: int = _option(1_000_000, "most JSON values (and object keys) a completion body may hold, counted "
                                              "before it is parsed; more get 400 (parsed, a value costs kvtier 8-184 "
                                              "bytes; 0 = no limit)", _int)
    max_json_depth: int = _option(128, "deepest nesting of arrays and objects a completion body (a JSON schema in it "
                                       "too) may have; deeper get 400 (1-254: kvtier re-encodes bodies with orjson, "
                                       "which stops at 255)", _int)
    max_grammar_chars: int = _option(1_000_000, "longest GBNF grammar (characters) a completion may carry; longer get "
                                              "400 (0 = no limit)", _int)
    max_grammar_depth: int = _option(256, "most groups a GBNF grammar may nest, ((...)) being 2; deeper get 400 "
                                          "(llama-server's grammar parser crashed at 20,000: llama.cpp #26600; "
                                          "0 = no limit)", _int)
    allow_slot_actions: bool = _option(False, "pass clients' POST /slots/N?action=save|restore|erase to llama-server "
                                              "(with the bearer token when one is set); off: 403, kvtier owns the "
                                              "slots", _bool)
    queue_limit: int = _option(32, "pending background Redis write jobs (one per saved slot) before the oldest "
                                   "is dropped", _int)
    save_defer: float = _option(10.0, "longest a save waits after its answer while other slots compute "
                                      "(llama-server's write of the slot stops them, kvtier's work takes CPU "
                                      "from them); it goes at once when a request wants its slot, and past half of it, "
                                      "beside a prompt with ten times its write left to compute. 0: never waits",
                                _float)
    save_wait: float = _option(2.0, "longest a request waits for another node's save in flight that holds more of "
                                     "its prompt than the tiers do; the cost model may wait less (0: never wait)",
                               _float)
    llama_cache_ram: int | None = _option(None, "llama-server's own --cache-ram (MiB; -1 no limit, 0 off): kvtier "
                                                "leaves to llama-server's prompt cache what it would serve by itself "
                                                "(unset: kvtier tests once per llama-server process, with three "
                                                "one-token completions in an idle slot, and assumes the default "
                                                "8 GiB when there is one)", _int)
    save_prompt_end: bool = _option(False, "sliding-window, hybrid and recurrent models: before answering, compute "
                                           "the prompt but its last token and save that state too, for templates "
                                           "that drop earlier reasoning from the history (thinking models): their "
                                           "next prompt continues the prompt, not the answer (costs a slot save "
                                           "before each answer)", _bool)
    restore_min_tokens: int = _option(0, "never restore fewer tokens than this (0 = cost model decides)", _int)
    prefill_tps_prior: float = _option(300.0, "prior prefill rate (tokens/s) before one is measured", _float)
    restore_gbps_prior: float = _option(0.5, "prior restore bandwidth (GB/s) before one is measured", _float)
    prewarm: bool = _option(False, "prefetch chunks announced by other nodes into the local tiers", _bool)
    advertise_url: str | None = _option(None, "URL peers reach this sidecar at (http://POD_IP:8081); with redis_url, "
                                               "this node publishes the prefixes its slots hold and its load in the "
                                               "fleet view, so peers can forward requests to it")
    forward: bool = _option(False, "forward a completion to the peer sidecar whose slots hold its prefix hot when "
                                   "the cost model (restore, recompute, the peer's queue) says it answers sooner "
                                   "(needs redis_url and chunk_key: only peers whose fleet status carries a "
                                   "valid, fresh MAC receive requests)", _bool)
    forward_timeout: float = _option(1.0, "seconds to connect to a peer; a peer that cannot be reached, answers "
                                          "with an error or leaves the fleet view before its answer starts leaves "
                                          "the request to this node", _float)
    forward_first_byte_timeout: float = _option(120.0, "seconds a peer has to start its answer to a forwarded "
                                                       "request (its status and headers: a streamed completion's "
                                                       "come with its first token, another's with the whole "
                                                       "answer); past it the request is served here", _float)
    forward_total_timeout: float = _option(600.0, "seconds a forwarded request may take in all, its answer's "
                                                  "last byte included; an answer still running then is cut off",
                                           _float)
    shutdown_timeout: float = _option(20.0, "seconds to drain requests and writes on SIGTERM", _float)
    save_nice: int = _option(0, "how far below the sidecar's CPU priority the threads run that cut a save into "
                                "chunks and send them to Redis (0-19; 0 = the sidecar's own priority). Above 0 a "
                                "save thread that holds the GIL waits for a core with it, and the event loop "
                                "with it: --save-cpu-share is the better bound", _int)
    save_cpu_share: float = _option(0.25, "share of one core (0-1] the save's work (cutting chunks, sending them "
                                          "to Redis) takes while requests compute and the host's tasks wait for "
                                          "its CPUs (1 = no bound)", _float)
    keep_restore_files: int = _option(1 << 30, "bytes of restore files (one per slot) and of read save files "
                                               "kept in the slot dir for later restores and saves to be written "
                                               "over: no new pages to allocate (0 = remove each after use)", _size)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)

    def redacted(self) -> dict[str, Any]:
        """The effective settings with secrets hidden (for the start-up log)."""
        out: dict[str, Any] = {}
        for name, option in OPTIONS.items():
            value = getattr(self, name)
            out[name] = option.redact(value) if option.redact is not None and value else value
        return out


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(Settings)}


def env_var(name: str) -> str:
    return "KVTIER_" + name.upper()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``ConfigError`` line instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvtier serve", description="KV-cache sidecar in front of llama-server")
    p.add_argument("--config", help="YAML file with any of the settings below (keys with _ or -)")
    for f in fields(Settings):
        option = OPTIONS[f.name]
        if option.parse is _bool:
            p.add_argument(flag(f.name), dest=f.name, action="store_const", const=True, default=None,
                           help=option.help)
            continue
        shown = option.shown_default(f.default)
        help_text = option.help if shown is None else f"{option.help} (default: {shown})"
        p.add_argument(flag(f.name), dest=f.name, default=None, help=help_text)
    return p


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge defaults, the YAML file, ``KVTIER_*`` env vars and flags; validate the result."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    given: dict[str, Any] = {}
    config_path = args.config or env.get("KVTIER_CONFIG")
    if config_path:
        given.update(_read_yaml(config_path))
    for name in OPTIONS:
        value = env.get(env_var(name))
        if value is not None and value != "":
            given[name] = value
    for name in OPTIONS:
        value = getattr(args, name)
        if value is not None:
            given[name] = value
    values: dict[str, Any] = {name: None if value is None else OPTIONS[name].parse(name, value)
                              for name, value in given.items()}
    values["redis_password"] = _secret(values, "redis_password", "redis_password_file")
    values["auth_token"] = _secret(values, "auth_token", "auth_token_file")
    values["chunk_key"] = _secret(values, "chunk_key", "chunk_key_file")
    if not values.get("node_id"):
        values["node_id"] = socket.gethostname()
    settings = Settings(**values)
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
        if name not in OPTIONS:
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


# A Unix socket's path in bytes, at most (``sun_path`` is 108 bytes with its terminating NUL on Linux).
MAX_SOCKET_PATH = 107


def check_llama(llama_url: str, path: str | None) -> None:
    """``llama_url``: an http(s) URL; ``llama_socket``: a path the kernel takes for a Unix socket,
    for plain HTTP."""
    url = urlsplit(llama_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"llama_url: expected http(s)://host:port, got {llama_url!r}")
    if path is None:
        return
    if not path or "\0" in path:
        raise ConfigError(f"llama_socket: expected the path of llama-server's Unix socket, got {path!r}")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"llama_socket: {len(os.fsencode(path))} bytes is over the {MAX_SOCKET_PATH} a Unix "
                          f"socket's path may have: {path!r}")
    if url.scheme != "http":
        raise ConfigError("llama_socket: a Unix socket carries plain HTTP; llama_url must be http://, "
                          f"not {url.scheme}://")


def validate(s: Settings) -> None:
    host, _, port = s.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen: expected HOST:PORT, got {s.listen!r}")
    check_llama(s.llama_url, s.llama_socket)
    if not s.slot_dir:
        raise ConfigError("slot_dir is required: the directory llama-server was given as --slot-save-path")
    if s.redis_url is not None:
        parse_redis_url(s.redis_url)  # the tier's own parser: one definition of what a Redis URL may be
    if not 0 <= s.save_nice <= 19:
        raise ConfigError(f"save_nice must be within 0-19, got {s.save_nice}")
    if not 0 < s.save_cpu_share <= 1:
        raise ConfigError(f"save_cpu_share must be within (0, 1], got {s.save_cpu_share}")
    for name in ("cache_size", "stream_window", "body_timeout", "queue_limit"):
        if getattr(s, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    if s.shared_dir is not None and s.shared_size <= 0:
        raise ConfigError("shared_size must be positive when shared_dir is set")
    if not 16 <= s.chunk_tokens <= 65536:
        raise ConfigError(f"chunk_tokens must be in 16..65536, got {s.chunk_tokens}")
    if s.compress not in COMPRESSIONS:
        raise ConfigError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {s.compress!r}")
    if s.ttl < 0:
        raise ConfigError(f"ttl must not be negative, got {s.ttl}")
    if s.chunk_key is not None and len(s.chunk_key.encode()) < MIN_MAC_KEY_BYTES:
        raise ConfigError(f"chunk_key must be at least {MIN_MAC_KEY_BYTES} bytes")
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
    if s.max_prompt_chars < 0:
        raise ConfigError("max_prompt_chars must not be negative")
    if s.max_json_values < 0 or s.max_grammar_chars < 0 or s.max_grammar_depth < 0:
        raise ConfigError("max_json_values, max_grammar_chars and max_grammar_depth must not be negative")
    if not 1 <= s.max_json_depth <= 254:
        raise ConfigError(f"max_json_depth must be in 1..254, got {s.max_json_depth}")
    for name, most in (("save_defer", 600), ("save_wait", 60)):
        if not 0 <= getattr(s, name) <= most:
            raise ConfigError(f"{name} must be between 0 and {most} seconds")
    if s.llama_cache_ram is not None and s.llama_cache_ram < -1:
        raise ConfigError(f"llama_cache_ram must be -1 (no limit), 0 (off) or a size in MiB, got {s.llama_cache_ram}")
    if s.restore_min_tokens < 0:
        raise ConfigError("restore_min_tokens must not be negative")
    if s.prefill_tps_prior <= 0 or s.restore_gbps_prior <= 0:
        raise ConfigError("cost-model priors must be positive")
    if s.prewarm and not s.redis_url:
        raise ConfigError("prewarm needs redis_url (events come through Redis pub/sub)")
    _validate_fleet(s)
    if s.shutdown_timeout < 0:
        raise ConfigError("shutdown_timeout must not be negative")
    if s.node_id and not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", s.node_id):
        raise ConfigError(f"node_id may hold letters, digits, '.', '_' and '-' (1-128), got {s.node_id!r}")


def _validate_fleet(s: Settings) -> None:
    if s.forward and not s.redis_url:
        raise ConfigError("forward needs redis_url (the fleet view is in Redis)")
    if s.forward and not s.chunk_key:
        # The fleet view names the URLs requests (prompts, bearer tokens) are sent to: without the
        # secret, whoever can write to Redis could name their own.
        raise ConfigError("forward needs chunk_key or chunk_key_file, the same secret on every node: peers "
                          "prove they belong to the fleet with it (a MAC on their status)")
    if s.advertise_url is not None:
        try:
            parse_peer_url(s.advertise_url)
        except ValueError as exc:
            raise ConfigError(f"advertise_url: expected http(s)://host[:port], got {s.advertise_url!r}: {exc}") from None
    if s.forward_timeout <= 0 or s.forward_first_byte_timeout <= 0:
        raise ConfigError("forward_timeout and forward_first_byte_timeout must be positive")
    if s.forward_total_timeout < s.forward_first_byte_timeout:
        raise ConfigError("forward_total_timeout must be at least forward_first_byte_timeout")
