"""`answer_fine` lets the proxy skip `classify` for the common answer (router/upstream/
proxy.py `forward`): it must never pass an answer `classify` would refuse, and must
pass the plain 2xx it exists for. Checked over every combination of status, content
type and content coding below, each answer a value object with what `classify` reads."""

from __future__ import annotations

import itertools

from multidict import CIMultiDict

from router.fleet.workers import Breaker, Worker
from router.upstream.answers import AttemptFailed, answer_fine, classify
from shared.wire.registry import WorkerRecord

STATUSES = (100, 101, 200, 201, 204, 206, 299, 300, 301, 307, 400, 404, 429, 500, 502, 503)
TYPES = ("application/json", "text/event-stream", "text/html", "application/jsonx", "")
CODINGS = (None, "identity", " Identity ", "gzip", "br", "")


class Answered:
    """An answer whose head has arrived (router/upstream/transport.py `Answer`)."""

    def __init__(self, status: int, content_type: str, coding: str | None) -> None:
        self.status, self.content_type = status, content_type
        self.headers = CIMultiDict({"Content-Type": content_type})
        if coding is not None:
            self.headers["Content-Encoding"] = coding

    async def read_all(self) -> bytes:
        return b'{"error": {"code": "overloaded"}}'


def _worker() -> Worker:
    record = WorkerRecord("w", "http://127.0.0.1:9", model="", engine="", epoch=0.0)
    return Worker("w", "http://127.0.0.1:9", "static", Breaker(3, 5.0), record)


async def test_a_fine_answer_is_one_classify_accepts() -> None:
    worker, fine = _worker(), 0
    for status, kind, coding in itertools.product(STATUSES, TYPES, CODINGS):
        answer = Answered(status, kind, coding)
        try:
            await classify(answer, worker)  # type: ignore[arg-type]
            accepted = True
        except AttemptFailed:
            accepted = False
        if answer_fine(answer):  # type: ignore[arg-type]
            fine += 1
            assert accepted, (status, kind, coding)
        plain = 200 <= status < 300 and kind in ("application/json", "text/event-stream")
        assert answer_fine(answer) is (plain and coding is None), (status, kind, coding)  # type: ignore[arg-type]
    assert fine == 5 * 2  # 200, 201, 204, 206, 299 of either answer type, no coding
