"""The namespaces benchmark runs both arms on one stream, and the keyed router predicts
no hit an engine that honours cache_salt and templates serves as a miss."""

from __future__ import annotations

from loadtests.router.bench_kv_events import ns_run_arm as run_arm
from loadtests.router.bench_kv_events import ns_workload as workload


def test_keyed_predicts_no_hit_across_namespaces_and_today_does() -> None:
    stream = workload(groups=2, questions=2, seed=1)
    today, keyed = (run_arm(k, stream, per_model=2, seed=1) for k in (False, True))
    assert today["wasted"] > 0 and today["false_requests"] > 0
    assert keyed["wasted"] == 0 and keyed["false_requests"] == 0
    assert abs(keyed["predicted"] - keyed["cached"]) <= 1  # predicted / cached 1.00
