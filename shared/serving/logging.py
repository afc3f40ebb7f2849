"""Logging as both services set it up: one format to stderr, and aiohttp's server log
kept free of request bytes."""

from __future__ import annotations

import logging
import sys

from aiohttp.http_exceptions import HttpProcessingError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RedactMalformedRequests(logging.Filter):
    """aiohttp.server logs a request it cannot parse with the offending line (it can hold
    an API key or prompt text) in the exception: keep the event, drop the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed HTTP request refused: %s", (type(exc).__name__,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def setup_logging(level: str) -> None:
    """Called once by each service's CLI, before it serves."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=FORMAT)
    logging.getLogger("aiohttp.server").addFilter(RedactMalformedRequests())
