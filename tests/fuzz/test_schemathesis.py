"""Schemathesis fuzzes both services from their own `GET /openapi.json`, as real processes.

The worker and the router run as subprocesses (the router fronts that one worker by a
static URL, no Redis), started once per module. Every operation gets a bounded number
of generated requests (valid and invalid); each answer must not be a 5xx, must be a
documented status with a documented content type, and an error must have the OpenAI
shape the document declares. A hang fails through the request timeout.

The worker's context is kept small (`--max-model-len 512`) so a generated `max_tokens`
never makes the sim generate for long; the router has no admin key, so the fuzzer's
`POST /workers` cannot fill the fleet with unreachable workers (403 is documented).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from loadtests.load.cluster import Cluster, WorkerSpec
from router.http.openapi import build_openapi
from shared.procs import http_json
from worker.http.openapi import openapi_document

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_EXAMPLES = 30
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples every CI run: a failure reproduces
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Cluster]:
    fleet = Cluster(redis=False)
    try:
        spec = WorkerSpec(
            decode_ms=0.0, extra=("--max-model-len", "512", "--max-body-bytes", "65536")
        )
        worker = fleet.start_worker("w0", spec)
        fleet.start_router({"max_body_bytes": 65536}, worker_urls=(worker.url,), want_workers=1)
        yield fleet
    finally:
        fleet.close()


# The documents come from the same builders the services serve them from (checked equal
# below): schemathesis' lazy `from_fixture` loader does not run under pytest 9.
WORKER_DOC = openapi_document("sim")
ROUTER_DOC = build_openapi()
worker_api = schemathesis.openapi.from_dict(WORKER_DOC)
router_api = schemathesis.openapi.from_dict(ROUTER_DOC)


def test_served_documents_are_the_fuzzed_ones(fleet: Cluster) -> None:
    assert fleet.router is not None
    assert http_json(fleet.workers["w0"].url + "/openapi.json") == (200, WORKER_DOC)
    assert http_json(fleet.router.url + "/openapi.json") == (200, ROUTER_DOC)


@worker_api.parametrize()
@FUZZ_SETTINGS
def test_worker_api(case: schemathesis.Case, fleet: Cluster) -> None:
    case.call_and_validate(base_url=fleet.workers["w0"].url, checks=CHECKS, timeout=30)


@router_api.parametrize()
@FUZZ_SETTINGS
def test_router_api(case: schemathesis.Case, fleet: Cluster) -> None:
    assert fleet.router is not None
    case.call_and_validate(base_url=fleet.router.url, checks=CHECKS, timeout=30)


def test_both_still_serve_after_fuzzing(fleet: Cluster) -> None:
    assert fleet.router is not None
    body = {"prompt": "still alive", "max_tokens": 2}
    for base in (fleet.workers["w0"].url, fleet.router.url):
        status, answer = http_json(base + "/v1/completions", "POST", body)
        assert status == 200, answer
    assert all(c.alive for c in [fleet.router, *fleet.workers.values()])


def test_worker_documents_its_stream_events(fleet: Cluster) -> None:
    operation = worker_api["/v1/completions"]["POST"]
    case = operation.Case(body={"prompt": "stream me", "max_tokens": 3, "stream": True})
    case.call_and_validate(
        base_url=fleet.workers["w0"].url, checks=[response_schema_conformance], timeout=30
    )
