"""The namespaces benchmark runs its arms on one stream, and the fully keyed router
predicts no hit an engine that honours cache_salt, templates and LoRA adapters serves as
a miss, on both layouts: each model on its own workers, and one fleet serving the base
model and both adapters on every worker."""

from __future__ import annotations

from loadtests.router.bench_kv_events import ns_run_arm as run_arm
from loadtests.router.bench_kv_events import ns_workload as workload


def test_keyed_predicts_no_hit_across_namespaces_and_today_does() -> None:
    stream = workload(groups=2, questions=2, seed=1)
    for shared in (False, True):
        today, salted, keyed = (
            run_arm(k, stream, per_model=2, seed=1, shared=shared)
            for k in ("none", "salt", "adapter")
        )
        assert today["wasted"] > 0 and today["false_requests"] > 0
        assert keyed["wasted"] == 0 and keyed["false_requests"] == 0
        assert abs(keyed["predicted"] - keyed["cached"]) <= 1  # predicted / cached 1.00
        # Keyed without the adapter, its unsalted requests on a shared worker were
        # predicted the base model's (and the other adapter's) blocks.
        assert (salted["false_requests"] > 0) == shared, salted
