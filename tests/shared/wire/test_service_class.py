"""A request's class from `service_tier` or vLLM's `priority` (shared/wire/service_class.py):
the same on both services, a 400 naming the field for anything else."""

from __future__ import annotations

import json

import pytest

from shared.serving.errors import APIError
from shared.wire.service_class import request_class, with_priority


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, ("standard", 0)),
        ({"service_tier": "priority"}, ("interactive", -1)),
        ({"service_tier": "default"}, ("standard", 0)),
        ({"service_tier": "auto"}, ("standard", 0)),
        ({"service_tier": "flex"}, ("batch", 1)),
        ({"priority": -5}, ("interactive", -5)),
        ({"priority": 0}, ("standard", 0)),
        ({"priority": 7}, ("batch", 7)),
        ({"service_tier": "flex", "priority": -3}, ("batch", -3)),  # the tier names the class
        ({"service_tier": None, "priority": None}, ("standard", 0)),
    ],
)
def test_classes(body: dict, expected: tuple[str, int]) -> None:
    assert request_class(body) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"service_tier": "scale"}, "service_tier"),
        ({"service_tier": ["priority"]}, "service_tier"),
        ({"priority": "1"}, "priority"),
        ({"priority": 1.0}, "priority"),
        ({"priority": False}, "priority"),
        ({"priority": -(1 << 31)}, "priority"),
        ({"priority": 1 << 200}, "priority"),
    ],
)
def test_bad_fields_are_400_naming_them(body: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        request_class(body)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param + ":")


@pytest.mark.parametrize("raw", [b'{"prompt": "x"}', b'  {\n "a": [1, {"b": 2}]}', b"{}", b"{ }"])
def test_with_priority_adds_one_key_and_keeps_the_rest(raw: bytes) -> None:
    out = with_priority(raw, -1)
    assert json.loads(out) == {"priority": -1, **json.loads(raw)}


def test_with_priority_refuses_what_is_not_an_object() -> None:
    with pytest.raises(ValueError):
        with_priority(b"[1]", 0)
