"""Log lines: JSON with the id of the request they were logged for."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.logs import JsonFormatter, request_id, setup_logging
from tests.servers import free_port
from tests.sidecars import run_sidecar


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Logging set up as `kvtier serve --log-format json` does, into a buffer; pytest's handlers back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = io.StringIO()
    setup_logging("json", "INFO", stream=out)
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def test_a_request_logs_with_its_id(stream: io.StringIO, tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # llama-server is down: passing a request through logs a warning
    async with run_sidecar(Settings(llama_url=down, slot_dir=str(tmp_path), node_id="logs")) as sc, \
            aiohttp.ClientSession() as session:
        async with session.get(sc.url + "/props", headers={"X-Request-Id": "req-42"}) as r:
            assert r.status == 502
        async with session.get(sc.url + "/props") as r:
            assert r.status == 502
            generated = r.headers["X-Request-Id"]
    unreachable = [line for line in lines(stream) if str(line["msg"]).startswith("llama-server unreachable")]
    assert [line.get("request_id") for line in unreachable] == ["req-42", generated]
    assert all(line["level"] == "warning" and line["logger"] == "kvtier.proxy" for line in unreachable)


def test_lines_outside_a_request_have_no_id(stream: io.StringIO) -> None:
    logging.getLogger("kvtier.test").info("no request here")
    token = request_id.set("r-1")
    try:
        logging.getLogger("kvtier.test").warning("inside %s", "one")
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("other").exception("failed")
    finally:
        request_id.reset(token)
    first, second, third = lines(stream)
    assert first["msg"] == "no request here" and "request_id" not in first
    assert second["msg"] == "inside one" and second["request_id"] == "r-1"
    assert third["request_id"] == "r-1" and "ValueError: bad" in str(third["exc"])


def test_json_formatter_alone() -> None:
    record = logging.LogRecord("kvtier", logging.INFO, __file__, 1, "x=%d", (5,), None)
    assert json.loads(JsonFormatter().format(record)) == {"ts": round(record.created, 3), "level": "info",
                                                          "logger": "kvtier", "msg": "x=5"}
