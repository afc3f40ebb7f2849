"""One request id through router → worker → both services' access logs, with no prompt
text in either log (real processes, their own log files)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from loadtests.load.cluster import Cluster, WorkerSpec
from shared.procs import Child, http_json
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
SECRET = "zebra-quartz-7781"  # prompt text that must not reach any log


async def test_request_id_is_generated_forwarded_and_logged_without_the_prompt() -> None:
    with Cluster() as fleet:
        await asyncio.to_thread(fleet.start_worker, "w0", WorkerSpec(decode_ms=1.0))
        router = await asyncio.to_thread(fleet.start_router)
        body = {"prompt": f"tell me about {SECRET}", "max_tokens": 4}
        status, _ = await asyncio.to_thread(http_json, router.url + "/v1/completions", "POST", body)
        assert status == 200
        # A client's own id is kept; an unusable one (spaces, too long) is replaced.
        for given, kept in (
            ("client-id-42", True),
            ("bad id\twith tab", False),
            ("x" * 200, False),
        ):
            req = urllib.request.Request(
                router.url + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "x-request-id": given}, method="POST",
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as r:
                rid = r.headers["x-request-id"]
            assert (rid == given) is kept and rid

        def logged(child: Child, name: str) -> int:
            return sum(name in ln and "/v1/completions" in ln for ln in child.output().splitlines())

        worker = fleet.workers["w0"]
        await wait_until(  # the access lines of all four requests are flushed
            lambda: logged(router, "router.access") == logged(worker, "worker.access") == 4,
            blocking=True,
        )
        router_log, worker_log = router.output(), worker.output()
    router_lines = [
        ln for ln in router_log.splitlines() if "router.access" in ln and "/v1/completions" in ln
    ]
    worker_lines = [
        ln for ln in worker_log.splitlines() if "worker.access" in ln and "/v1/completions" in ln
    ]
    assert len(router_lines) == len(worker_lines) == 4
    for rl in router_lines:
        rid = rl.split("request_id=")[1].split()[0]
        assert "status=200" in rl and "worker=w0" in rl and "route=" in rl
        assert any(f"request_id={rid} " in wl for wl in worker_lines), rid  # the same id
    assert any("request_id=client-id-42 " in wl for wl in worker_lines)
    assert SECRET not in router_log and SECRET not in worker_log
