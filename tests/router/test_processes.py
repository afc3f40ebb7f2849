"""`serve --processes N` configuration: what each child runs, and what is refused."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from router.cli import build_parser, serve_config
from router.processes import STOP_MARGIN_S, child_config
from shared.config import ConfigError, RouterConfig
from shared.procs import Child, free_port, http_json, wait_until


def test_children_sync_through_redis_and_need_a_fixed_port() -> None:
    config = RouterConfig(processes=4, port=8000, redis_url="redis://127.0.0.1:6379")
    assert child_config(config).sync and child_config(config).processes == 4
    lone = RouterConfig(processes=2, port=8000)  # no Redis: nothing to sync through
    assert not child_config(lone).sync
    with pytest.raises(ConfigError, match="fixed port"):
        child_config(RouterConfig(processes=2, port=0))


def test_the_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["serve", "--processes", "3", "--port", "9000"])
    assert serve_config(args).processes == 3
    assert serve_config(build_parser().parse_args(["serve"])).processes == 1
    with pytest.raises(ValueError):
        RouterConfig(processes=0)


@pytest.mark.timeout(60)
def test_sigterm_lets_each_process_serve_its_shutdown_delay_then_drain(tmp_path: Path) -> None:
    """The parent waits for the children's whole stop: a shutdown_delay longer than its
    margin got every child SIGKILLed while it still served (and before it drained)."""
    port = free_port()
    delay = STOP_MARGIN_S + 1
    router = Child(
        "router", ["router", "serve", "--port", str(port), "--processes", "2"],
        f"http://127.0.0.1:{port}", tmp_path / "router.log",
        {"RADIX_ROUTER_SHUTDOWN_DELAY": str(delay), "RADIX_ROUTER_DRAIN_TIMEOUT": "0"},
    ).start()  # fmt: skip
    try:
        wait_until(lambda: _alive(router.url), 30, router)
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)  # the parent only: it passes it on
        assert router.wait(delay + STOP_MARGIN_S + 10) == 0
        assert "killed" not in router.output(), router.tail()
    finally:
        router.stop()


def _alive(url: str) -> bool:
    try:
        return http_json(url + "/liveness", timeout=1)[0] == 200
    except OSError:
        return False
