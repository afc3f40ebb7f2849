"""The worker's side of prompt_cache_key and cache_pin_ttl over real HTTP (the official
openai client against a sim worker): which TTL a request gets (its own, its class's
default, the worker's default), the clamp reported in usage, and that a key alone pins
nothing unless a default says so."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.worker.conftest import WorkerThread, sim_config


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    config = sim_config(
        pin_max_ttl_s=100.0, pin_default_ttl_s=30.0, pin_class_ttl_s={"interactive": 90.0}
    )
    with WorkerThread(config) as worker:
        yield OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)


def pin_of(client: OpenAI, **body: object) -> object:
    reply = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "tool output " * 30}],
        max_tokens=2, extra_body=body,
    )  # fmt: skip
    assert reply.usage is not None
    return (reply.usage.model_extra or {}).get("cache_pin")


def test_the_ttl_a_request_gets(client: OpenAI) -> None:
    assert pin_of(client) is None  # no key, no TTL: nothing pinned
    assert pin_of(client, prompt_cache_key="k1") == {
        "ttl_s": 30.0, "requested_ttl_s": 30.0, "clamped": False,
    }  # fmt: skip
    assert pin_of(client, prompt_cache_key="k2", service_tier="priority")["ttl_s"] == 90.0  # type: ignore[index]
    assert pin_of(client, prompt_cache_key="k3", cache_pin_ttl=10)["ttl_s"] == 10.0  # type: ignore[index]
    assert pin_of(client, cache_pin_ttl=500) == {
        "ttl_s": 100.0, "requested_ttl_s": 500.0, "clamped": True,
    }  # fmt: skip


def test_bad_pin_fields_are_refused_naming_them(client: OpenAI) -> None:
    import openai

    for body, param in (
        ({"cache_pin_ttl": -1}, "cache_pin_ttl"),
        ({"cache_pin_ttl": "5m"}, "cache_pin_ttl"),
        ({"prompt_cache_key": "x" * 1025}, "prompt_cache_key"),
        ({"prompt_cache_key": "é" * 513}, "prompt_cache_key"),  # 513 characters, 1,026 bytes
        ({"prompt_cache_key": ["k"] * 2000}, "prompt_cache_key"),
        ({"cache_pin_ttl": 86_401}, "cache_pin_ttl"),
        ({"cache_pin_ttl": True}, "cache_pin_ttl"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            pin_of(client, **body)
        assert isinstance(e.value.body, dict) and e.value.body["param"] == param, body


def _post(url: str, body: bytes) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + "/release_pin", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_moved_sessions_pin_is_released_and_bad_releases_are_refused(client: OpenAI) -> None:
    """POST /release_pin (the router moved the session elsewhere): the key's pin goes,
    once; bad bodies get the OpenAI error shape naming the field, an oversized one 413."""
    url = str(client.base_url).removesuffix("/v1/")
    pin_of(client, prompt_cache_key="moving", cache_pin_ttl=60)
    assert _post(url, b'{"prompt_cache_key": "moving"}') == (200, {"released": True})
    assert _post(url, b'{"prompt_cache_key": "moving"}') == (200, {"released": False})
    for body, status in (
        (b'{"prompt_cache_key": 7}', 400),
        (b"{}", 400),
        (b'{"prompt_cache_key": "' + b"x" * 1025 + b'"}', 400),
        (('{"prompt_cache_key": "' + "é" * 513 + '"}').encode(), 400),  # 1,026 bytes
        (b'{"prompt_cache_key": "' + b"x" * 5000 + b'"}', 413),
        (b"not json", 400),
    ):
        code, answer = _post(url, body)
        assert code == status and set(answer["error"]) >= {"message", "type", "code"}, body
        if status == 400 and body.startswith(b'{"prompt'):
            assert answer["error"]["param"] == "prompt_cache_key"
