"""The one logging setup both services call: a request aiohttp cannot parse is logged
without its bytes (they can hold an API key or a prompt)."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadStatusLine

from shared.serving.logging import RedactMalformedRequests


def record(exc: BaseException | None) -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(
        "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request %s", ("x",), info
    )


def test_malformed_request_is_logged_without_its_bytes() -> None:
    secret = "GET /v1 Bearer sk-secret-key"
    rec = record(BadStatusLine(secret))
    assert RedactMalformedRequests().filter(rec)
    text = logging.Formatter().format(rec)
    assert secret not in text and "sk-secret" not in text
    assert "malformed HTTP request refused: BadStatusLine" in text and rec.levelname == "INFO"


def test_other_records_pass_unchanged() -> None:
    rec = record(ValueError("a bug"))  # positive control: same filter, record kept as is
    assert RedactMalformedRequests().filter(rec)
    assert rec.levelno == logging.ERROR and "a bug" in logging.Formatter().format(rec)
