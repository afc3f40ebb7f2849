"""`serve --processes N` configuration: what each child runs, and what is refused."""

from __future__ import annotations

import pytest

from router.cli import build_parser, serve_config
from router.processes import child_config
from shared.config import ConfigError, RouterConfig


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
