"""Settings: one declaration feeds flags, env vars, YAML keys, defaults, the README and the start-up log."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.cli import main
from sidecar.config import OPTIONS, Settings, build_parser, env_var, flag, load_settings

README = Path(__file__).parent.parent / "README.md"

# A value for every setting as a user would write it, and what kvtier makes of it (True: a bare flag).
SAMPLES: dict[str, tuple[Any, Any]] = {
    "listen": ("127.0.0.1:9000", "127.0.0.1:9000"),
    "llama_url": ("http://10.0.0.1:8080", "http://10.0.0.1:8080"),
    "llama_socket": ("/run/llama/llama-server.sock", "/run/llama/llama-server.sock"),
    "slot_dir": ("/tmp", "/tmp"),
    "redis_url": ("redis://r:6379/1", "redis://r:6379/1"),
    "redis_username": ("alice", "alice"),
    "redis_password": ("pw", "pw"),
    "redis_password_file": (None, None),  # a path, filled in by the test
    "cache_size": ("1G", 1 << 30),
    "stream_window": ("16M", 16 << 20),
    "eviction": ("lru", "lru"),
    "shared_dir": ("/dev/shm/kvtier-test", "/dev/shm/kvtier-test"),
    "shared_size": ("512M", 512 << 20),
    "chunk_tokens": ("64", 64),
    "compress": ("none", "none"),
    "ttl": ("60", 60),
    "chunk_key": ("a-secret-of-16-bytes-or-more", "a-secret-of-16-bytes-or-more"),
    "chunk_key_file": (None, None),  # a path, filled in by the test
    "node_id": ("node-7", "node-7"),
    "model": ("/models/m.gguf", "/models/m.gguf"),
    "model_id": ("my-model", "my-model"),
    "local_tokenizer": ("off", "off"),
    "log_format": ("json", "json"),
    "auth_token": ("tok", "tok"),
    "auth_token_file": (None, None),  # a path, filled in by the test
    "auth_all": (True, True),
    "max_body": ("2M", 2 << 20),
    "body_timeout": ("7.5", 7.5),
    "max_prompt_chars": ("100000", 100000),
    "max_json_values": ("5000", 5000),
    "max_json_depth": ("64", 64),
    "max_grammar_chars": ("20000", 20000),
    "max_grammar_depth": ("32", 32),
    "allow_slot_actions": (True, True),
    "queue_limit": ("8", 8),
    "save_wait": ("0.5", 0.5),
    "llama_cache_ram": ("2048", 2048),
    "save_prompt_end": (True, True),
    "restore_min_tokens": ("100", 100),
    "prefill_tps_prior": ("123.5", 123.5),
    "restore_gbps_prior": ("2.5", 2.5),
    "prewarm": (True, True),
    "advertise_url": ("http://10.0.0.7:8081", "http://10.0.0.7:8081"),
    "forward": (True, True),
    "forward_timeout": ("0.25", 0.25),
    "forward_first_byte_timeout": ("30", 30.0),
    "forward_total_timeout": ("900", 900.0),
    "shutdown_timeout": ("3.5", 3.5),
    "keep_restore_files": ("0", 0),
    "save_nice": ("0", 0),
    "save_cpu_share": ("0.5", 0.5),
    "save_defer": ("2.5", 2.5),
}
NEEDS = {"auth_all": {"auth_token": "tok"}, "prewarm": {"redis_url": "redis://r/0"},
         "forward": {"redis_url": "redis://r/0", "chunk_key": "a-fleet-secret-16+"}}  # what validation asks


def test_samples_cover_every_setting() -> None:
    assert set(SAMPLES) == {f.name for f in fields(Settings)} == set(OPTIONS)


def _given(name: str, tmp_path: Path) -> tuple[dict[str, Any], Any]:
    text, expected = SAMPLES[name]
    if name.endswith("_file"):
        secret = tmp_path / "secret"
        secret.write_text("from-a-file, 16+ bytes\n")  # chunk_key needs 16
        text = expected = str(secret)
    return {"slot_dir": str(tmp_path), **NEEDS.get(name, {}), name: text}, expected


@pytest.mark.parametrize("name", list(SAMPLES))
@pytest.mark.parametrize("source", ["flag", "env", "yaml", "yaml-dashes"])
def test_each_setting_by_flag_env_and_yaml(name: str, source: str, tmp_path: Path) -> None:
    given, expected = _given(name, tmp_path)
    if source == "flag":
        argv = [part for key, value in given.items()
                for part in ([flag(key)] if value is True else [flag(key), str(value)])]
        settings = load_settings(argv, env={})
    elif source == "env":
        env = {env_var(key): "true" if value is True else str(value) for key, value in given.items()}
        settings = load_settings([], env=env)
    else:
        cfg = tmp_path / "kvtier.yaml"
        keys = {key.replace("_", "-") if source == "yaml-dashes" else key: value for key, value in given.items()}
        cfg.write_text(yaml.safe_dump(keys))
        settings = load_settings(["--config", str(cfg)], env={})
    assert getattr(settings, name) == expected


def test_defaults_are_the_dataclass_defaults(tmp_path: Path) -> None:
    loaded = load_settings(["--slot-dir", str(tmp_path)], env={})
    assert replace(loaded, slot_dir=None, node_id="") == Settings()
    assert loaded.node_id  # the hostname


def test_flag_help_shows_defaults_as_written() -> None:
    helps = {action.dest: action.help or "" for action in build_parser()._actions}
    assert helps["cache_size"].endswith("(default: 2G)")
    assert helps["max_body"].endswith("(default: 32M)")
    assert helps["chunk_tokens"].endswith("(default: 256)")
    assert "(default" not in helps["auth_all"] and "(default: None)" not in helps["redis_url"]


def test_readme_flag_table_is_true() -> None:
    """Every flag the README's table names exists, and a single default it gives is the real one."""
    parser_flags = {option for action in build_parser()._actions for option in action.option_strings}
    rows = [line.split("|")[1:3] for line in README.read_text().splitlines() if line.startswith("| `--")]
    assert len(rows) >= 15
    for flags_cell, default_cell in rows:
        names: list[str] = []
        for base, file_too in re.findall(r"`(--[a-z-]+)(\(-file\))?`", flags_cell):
            names += [base, base + "-file"] if file_too else [base]
        assert names and set(names) <= parser_flags, flags_cell
        defaults = re.findall(r"`([^`]+)`", default_cell)
        if len(names) == 1 and len(defaults) == 1 and names[0] != "--config":
            dest = names[0][2:].replace("-", "_")
            shown = OPTIONS[dest].shown_default(Settings.__dataclass_fields__[dest].default)
            assert defaults[0] == shown, (names[0], defaults[0], shown)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """`kvtier serve` takes over the root logger; give it back to pytest afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_serve_logs_its_effective_config_without_secrets(
        log_format: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture, root_logging: None) -> None:
    secrets = ["USERINFO-SECRET", "SENTINEL-SECRET", "FLAG-SECRET", "TOKEN-SECRET"]
    url = ("redis+sentinel://alice:USERINFO-SECRET@127.0.0.1:26379,127.0.0.1:26380/mymaster/0"
           "?sentinel_password=SENTINEL-SECRET")
    served: list[Settings] = []
    monkeypatch.setattr("sidecar.app.run", served.append)  # everything `kvtier serve` does but serve
    logging.getLogger("kvtier").addHandler(caplog.handler)  # serve replaces the root's handlers
    try:
        rc = main(["serve", "--slot-dir", str(tmp_path), "--redis-url", url, "--redis-password", "FLAG-SECRET",
                   "--auth-token", "TOKEN-SECRET", "--log-format", log_format])
    finally:
        logging.getLogger("kvtier").removeHandler(caplog.handler)
    assert rc == 0 and served and served[0].redis_password == "FLAG-SECRET"
    printed = capsys.readouterr().err
    [record] = [r for r in caplog.records if r.getMessage().startswith("effective config: ")]
    for secret in secrets:
        assert secret not in printed and secret not in record.getMessage() and secret not in repr(served[0])
    logged = json.loads(record.getMessage().removeprefix("effective config: "))
    assert logged["redis_url"] == ("redis+sentinel://alice:***@127.0.0.1:26379,127.0.0.1:26380/mymaster/0"
                                   "?sentinel_password=***")
    assert logged["redis_password"] == logged["auth_token"] == "***"
    assert "effective config" in printed
