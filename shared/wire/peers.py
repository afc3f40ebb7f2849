"""What a peer may tell us about a worker: its id, its URL and its model, checked before use.

Worker ids and URLs arrive from Redis (anyone who can write to it), from the admin API
and from config. The URL ends up in the proxy, the id in response headers, metric
labels and Redis key names, so both are held to narrow shapes:

- an id is 1–128 characters of `A-Z a-z 0-9 . _ : -`, starting with a letter or digit
  (a CR/LF in an id made every answer through that worker an empty 200);
- a URL is exactly `http(s)://host:port` (an optional trailing `/`): no path, query,
  fragment or credentials;
- the host is a DNS name or an IP literal in its canonical form: `0x7f.1`, `2130706433`
  and `0177.0.0.1` are refused rather than guessed at (resolvers disagree on them);
- an address is never link-local (169.254.0.0/16, fe80::/10: where cloud metadata
  services live), a known metadata address, unspecified, multicast or broadcast; an
  IPv4-mapped IPv6 address (`::ffff:169.254.169.254`) is judged as the IPv4 it maps;
- with `worker_url_allow_cidrs` set (say, the pod network), a literal address must lie
  in one of them; DNS names are checked when they resolve (`router/upstream/resolver.py`), so a
  name cannot point somewhere a literal could not.

Loopback stays allowed unless the allow-list excludes it: local fleets run on it.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_DNS_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+")
_DOTTED_QUAD = re.compile(
    r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}"
)
# Metadata services outside the link-local ranges (AWS IPv6, Alibaba) and by name (GCP).
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}
)
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "instance-data"})


def check_worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str) or not WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"worker id must be 1-128 of A-Za-z0-9._:- , got {worker_id!r:.80}")
    return worker_id


def served_model(answer: object) -> str:
    """The base model's id in a `/v1/models` answer (the first entry without a `parent`,
    else the first), or "" when it names none. Anything but a list of objects with a
    printable id of at most 256 characters (what the registry accepts of a model) names
    none: a `{"data": 5}` once made the router's own `GET /v1/models` answer 500."""
    named = _model_entries(answer)
    return next((name for name, parent in named if parent is None), named[0][0] if named else "")


def served_adapters(answer: object) -> list[str]:
    """The LoRA adapters in a `/v1/models` answer: the ids with a `parent` (vLLM lists
    each `--lora-modules` adapter so, its parent the base model)."""
    return [name for name, parent in _model_entries(answer) if parent is not None]


def _model_entries(answer: object) -> list[tuple[str, object]]:
    models = answer.get("data") if isinstance(answer, dict) else None
    out = []
    for model in models if isinstance(models, list) else ():
        name = model.get("id") if isinstance(model, dict) else None
        if isinstance(name, str) and name and len(name) <= 256 and name.isprintable():
            out.append((name, model.get("parent")))  # type: ignore[union-attr]
    return out


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def address_refusal(address: IPAddress, allow: tuple[Network, ...] = ()) -> str | None:
    """Why a worker may not live at `address`, or None when it may."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in METADATA_ADDRESSES:
        return "a metadata address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_unspecified or address.is_multicast:
        return "not a unicast address"
    if isinstance(address, ipaddress.IPv4Address) and address == ipaddress.IPv4Address(
        "255.255.255.255"
    ):
        return "the broadcast address"
    if allow and not any(address in net for net in allow if net.version == address.version):
        return "outside worker_url_allow_cidrs"
    return None


def _literal(host: str) -> IPAddress | None:
    """The address a host literal names, None for a DNS name; ValueError for odd forms."""
    if ":" in host:  # only IPv6 literals hold colons (urlsplit removed the brackets)
        return ipaddress.IPv6Address(host.split("%", 1)[0])
    if _DOTTED_QUAD.fullmatch(host):
        return ipaddress.IPv4Address(host)
    if (
        host.replace(".", "").isdigit()
        or host.lower().startswith("0x")
        or not _DNS_NAME.fullmatch(host)
        or host.rsplit(".", 1)[-1].isdigit()
    ):
        raise ValueError("host must be a DNS name or a canonical IP address")
    return None


def check_worker_url(url: str, allow: tuple[Network, ...] = ()) -> str:
    """`url` without a trailing slash, or ValueError saying what is wrong with it."""
    if not isinstance(url, str) or len(url) > 512 or not url.isascii() or not url.isprintable():
        raise ValueError(f"worker URL must be http(s)://host:port, got {url!r:.80}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"worker URL must be http(s)://host:port, got {url!r:.80}")
    if parts.query or parts.fragment or parts.username or parts.password or "@" in parts.netloc:
        # Not echoed: the userinfo may be a password.
        raise ValueError("worker URL must not carry credentials, query or fragment")
    if parts.path not in ("", "/"):
        raise ValueError(f"worker URL must have no path: {url!r:.80}")
    host = parts.hostname
    try:
        address = _literal(host)
    except ValueError as e:
        raise ValueError(f"worker URL {url!r:.80}: {e}") from None
    if address is None:
        if host.lower().rstrip(".") in METADATA_NAMES:
            raise ValueError(f"worker URL {url!r:.80} names a metadata service")
        return url.rstrip("/")
    why = address_refusal(address, allow)
    if why is not None:
        raise ValueError(f"worker URL {url!r:.80}: {why}")
    return url.rstrip("/")


class Rejections:
    """What a boundary refused, counted per source (exported as a metric) and logged once
    per source and item, so a poisoned store that stays poisoned does not flood the log."""

    MAX_LOGGED = 1000

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()

    def reject(self, source: str, item: str, why: str) -> None:
        self.counts[source] = self.counts.get(source, 0) + 1
        key = (source, item[:80])
        if key not in self._logged and len(self._logged) < self.MAX_LOGGED:
            self._logged.add(key)
            log.warning("%s: refused %r: %s", source, item[:80], why)
