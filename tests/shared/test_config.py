from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.config import ConfigError, RouterConfig, WorkerConfig, dump_config, load_config


def test_defaults_and_frozen() -> None:
    cfg = load_config(RouterConfig, environ={})
    assert cfg.policy == "cache_aware"
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (
        0.3,
        64,
        1.5,
    )
    with pytest.raises(ValidationError):
        cfg.port = 1  # type: ignore[misc]


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.yaml"
    f.write_text("port: 9000\npolicy: round_robin\ncache_threshold: 0.5\n")
    env = {"RADIX_ROUTER_PORT": "9100", "RADIX_ROUTER_WORKER_URLS": "http://a:1, http://b:2/"}
    cfg = load_config(RouterConfig, file=f, environ=env, overrides={"port": 9200, "policy": None})
    assert cfg.port == 9200  # flag beats env beats file
    assert cfg.policy == "round_robin"  # a None flag is "not given"
    assert cfg.cache_threshold == 0.5
    assert cfg.worker_urls == ("http://a:1", "http://b:2")


def test_env_scalars_parse_as_yaml() -> None:
    env = {"RADIX_WORKER_CACHE_TOKENS": "4096", "RADIX_WORKER_DISABLE_RADIX_CACHE": "true"}
    cfg = load_config(WorkerConfig, environ=env)
    assert cfg.cache_tokens == 4096 and cfg.disable_radix_cache is True


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"polcy": "x"}, "polcy: unknown key (from flags)"),
        ({"policy": "fastest"}, "policy:"),
        ({"port": -1}, "port:"),
        ({"cache_threshold": 1.5}, "cache_threshold:"),
        ({"worker_urls": ["ftp://x:1"]}, "worker_urls"),
        ({"worker_urls": ["http://nohost"]}, "host:port"),
    ],
)
def test_bad_values_name_the_key(overrides: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(RouterConfig, overrides=overrides, environ={})
    assert needle in str(e.value)


def test_a_worker_id_routers_would_drop_is_refused_at_start() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(WorkerConfig, overrides={"worker_id": "w/1 bad"}, environ={})
    assert "worker_id" in str(e.value) and "A-Za-z0-9" in str(e.value)
    assert load_config(WorkerConfig, overrides={"worker_id": "w-1.a:b"}, environ={}).worker_id


def test_bad_env_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"heartbeat_interval: .*\(from environment\)"):
        load_config(WorkerConfig, environ={"RADIX_WORKER_HEARTBEAT_INTERVAL": "-1"})


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(WorkerConfig, file=tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(WorkerConfig, file=bad, environ={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("engine: sim\ncache_tokns: 5\n")
    with pytest.raises(ConfigError, match=r"cache_tokns: unknown key \(from file"):
        load_config(WorkerConfig, file=unknown, environ={})


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(WorkerConfig, overrides={"engine": "sim", "cache_tokens": 1000}, environ={})
    f = tmp_path / "w.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(WorkerConfig, file=f, environ={}) == cfg


def test_redis_password_file_is_checked_at_start(tmp_path: Path) -> None:
    """The chart's worker pods read their own Redis password from a file; a missing or
    empty file, or a URL that also carries a password, is refused naming the key."""
    url = {"RADIX_WORKER_REDIS_URL": "redis://radix-worker-w-0@redis:6379/0"}
    good = tmp_path / "password"
    good.write_text("s3cret\n")
    cfg = load_config(WorkerConfig, environ={**url, "RADIX_WORKER_REDIS_PASSWORD_FILE": str(good)})
    assert cfg.redis_password_file == str(good)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, needle in ((tmp_path / "missing", "cannot read"), (empty, "one non-empty line")):
        with pytest.raises(ConfigError, match=f"redis_password_file: .*{needle}"):
            load_config(WorkerConfig, overrides={"redis_password_file": str(path)}, environ=url)
    with pytest.raises(ConfigError, match="has a password"):
        load_config(
            WorkerConfig,
            overrides={"redis_url": "redis://u:pw@redis:6379/0", "redis_password_file": str(good)},
            environ={},
        )
    with pytest.raises(ConfigError, match="needs redis_url"):
        load_config(WorkerConfig, overrides={"redis_password_file": str(good)}, environ={})


def test_an_unknown_env_key_refuses_to_start_naming_the_nearest_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: ignored, although an unknown key in the file stops the service (issue 31)."""
    with pytest.raises(ConfigError) as e:
        load_config(RouterConfig, environ={"RADIX_ROUTER_CACHE_TRESHOLD": "0.9"})
    assert "RADIX_ROUTER_CACHE_TRESHOLD" in str(e.value)
    assert "did you mean RADIX_ROUTER_CACHE_THRESHOLD" in str(e.value)
    with pytest.raises(ConfigError, match="RADIX_WORKER_CACHE_TOKEN; did you mean "
                       "RADIX_WORKER_CACHE_TOKENS"):  # fmt: skip
        load_config(WorkerConfig, environ={"RADIX_WORKER_CACHE_TOKEN": "5"})
    # The other service's keys and Kubernetes service links are not this service's keys.
    links = {"RADIX_ROUTER_SERVICE_HOST": "10.0.0.1", "RADIX_ROUTER_PORT_8000_TCP_ADDR": "x",
             "RADIX_WORKER_CACHE_TOKENS": "5"}  # fmt: skip
    assert load_config(RouterConfig, environ=links).port == 8000
    # Through the command line: exit 2 with the one line.
    from router.cli import main

    monkeypatch.setenv("RADIX_ROUTER_CACHE_TRESHOLD", "0.9")
    assert main(["serve", "--port", "0"]) == 2
    assert "unknown environment key RADIX_ROUTER_CACHE_TRESHOLD" in capsys.readouterr().err
