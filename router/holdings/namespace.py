"""A request's cache namespace: what, beyond its prompt, decides which cached blocks an
engine may reuse for it. No hit is ever predicted across namespaces.

The key is the model, its LoRA adapter, the request's `cache_salt` (vLLM's field: a
salted prompt shares blocks only with prompts of the same salt) and, where the router
renders chats (a `tokenizer` is set), a `chat_template` or `chat_template_kwargs` the
request brings: the router renders with the model's own template, so its ids are not the
ones an engine that honours them computes. Routing on text, the router renders nothing
and keys no template (our engine ignores both fields: keyed apart, the same chat under two
`chat_template_kwargs` lost 32% of its cached tokens, loadtests/results/holdings.md).

- An adapter: vLLM serves each `--lora-modules` adapter under its own `model` name on
  the base model's workers, and keeps its blocks apart (the adapter's name is in every
  block's hash). A worker advertises them (`WorkerRecord.adapters`), and a request for a
  name some worker serves as an adapter is keyed apart from the base model, salt or no
  salt: one tree holds every model's keys per worker, and base and adapter requests on
  one worker would otherwise match each other's. SGLang names the adapter in the body
  (`lora_path`): keyed the same way.
- The default namespace of a model (no salt, the model's own template) is the empty
  string, and its keys are the plain text or ids: the fleet's view holds only workers
  that serve the request's model, so models are kept apart there, and routing where no
  namespace applies is unchanged (tests/router/policy/test_policy_equivalence.py).
- Any other namespace is a 64-bit digest of (model, salt, template, adapter), and the tree keys
  the request on `prefix + key`: a text key behind `NUL "ns:" digest NUL`, an id key
  behind four ids of `NS_ID_BASE + 16 bits` of the digest (above every real vocabulary;
  inside the 31-bit range KV events and replica sync carry). A match must cover the
  whole prefix to count, and the prefix's length is taken off every end, so two
  namespaces share nothing and lengths stay the request's own. Replica sync carries
  the prefixed key as it is: a replica files it under the same namespace. In a tree on
  ids, a request the router has no ids for is keyed by its text's code points behind
  the id `TEXT_IN_IDS` (after its namespace's tags): text never matches ids there.
- The KV-event index holds each model's default namespace only: a stored block whose
  hash mixed in anything beside its tokens (vLLM's `extra_keys`: the `cache_salt` on a
  salted prompt's first block, the LoRA name on every block of an adapter's; our engine
  writes the salt the same way), or that names a LoRA adapter (`lora_name`, or a
  `lora_id` alone, where the schema predates `extra_keys`), is not indexed, nor are the
  blocks stored below it (their parent is unknown to the index). A namespaced request
  is predicted from the tree alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from shared.wire.kv_events import BlockStored, KVEvent
from shared.wire.registry import MAX_NAME_CHARS

DEFAULT = ""
TEXT_TAG = "\x00ns:"
NS_ID_BASE = 2**31 - 2**16  # ids from here on are namespace tags, not tokens
ID_TAGS = 4
TEXT_IN_IDS = NS_ID_BASE - 1  # leads a text key in a tree on ids (router/holdings/room.py)
# A model or adapter name longer than MAX_NAME_CHARS (the registry's bound on a name,
# shared/wire/registry.py), or a chat template longer than this (a real one is a few KB),
# names no model or adapter a worker serves, and was digested whole on the event loop
# (a 15 MB `lora_path`: ~75 ms); it is keyed as TOO_LONG, apart from the default
# namespace, and the worker answers it as it answers any unknown name.
MAX_TEMPLATE_CHARS = 65_536
TOO_LONG = "\x00too long"
# `chat_template_kwargs` are a few flags (`{"enable_thinking": false}`), or documents a
# template renders. One past about MAX_KWARGS_CHARS of JSON, or nested deeper than
# MAX_KWARGS_DEPTH, is keyed as TOO_LONG too: it was serialized whole on the event loop
# (json.dumps with sorted keys: 38-80 ms for a 4 MB value on 2 busy cores). Its size is
# found by a walk that stops at the bound (`_kwargs_fit`), never by serializing it.
MAX_KWARGS_CHARS = 65_536
MAX_KWARGS_DEPTH = 32


def namespace_of(
    model: str | None,
    cache_salt: str | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    adapter: str | None = None,
) -> str:
    """The request's namespace: DEFAULT where only the model applies (a base model, no
    salt, its own template), else a digest of all of them."""
    if cache_salt is None and chat_template is None and not template_kwargs and adapter is None:
        return DEFAULT
    if template_kwargs and not _kwargs_fit(template_kwargs):
        kwargs = json.dumps(TOO_LONG)  # (a mapping's JSON starts with "{": no clash)
    else:
        kwargs = json.dumps(template_kwargs or {}, sort_keys=True, default=repr)
    parts = [model or "", cache_salt, chat_template, kwargs]
    if adapter is not None:  # (appended: salted namespaces keep their digests)
        parts.append(adapter)
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).hexdigest()


def request_namespace(parsed: object, renders: bool = True, adapter: bool = False) -> str:
    """The namespace of a parsed request (shared/wire/protocol.py's models): its model,
    whether that model is an `adapter` some worker serves (vLLM), SGLang's `lora_path`,
    its `cache_salt`, and where the router `renders` chats a chat's `chat_template` /
    `chat_template_kwargs` (vLLM's fields, passed through to the engine as extra fields)."""
    salt = getattr(parsed, "cache_salt", None)
    # `model_extra`'s own slot: the property is one call more a request.
    extra = getattr(parsed, "__pydantic_extra__", None)
    if not extra and salt is None and not adapter:  # most requests: nothing splits it
        return DEFAULT
    return fields_namespace(getattr(parsed, "model", None), salt, extra, renders, adapter)


def fields_namespace(
    model: str | None, salt: str | None, extra: Mapping[str, object] | None, renders: bool,
    adapter: bool,
) -> str:  # fmt: skip
    """`request_namespace` of a request's fields as its model holds them: `extra` its
    extra fields (the body's own, where shared/wire/plain_body.py took it as sent)."""
    if not extra and salt is None and not adapter:
        return DEFAULT
    extra = extra or {}
    lora_path = extra.get("lora_path")
    model = _bounded(model, MAX_NAME_CHARS)
    named = model if adapter else None
    if isinstance(lora_path, str) and lora_path:  # SGLang's adapter field
        named = f"{named or ''}\x00lora_path:{_bounded(lora_path, MAX_NAME_CHARS)}"
    template = extra.get("chat_template") if renders else None
    kwargs = extra.get("chat_template_kwargs") if renders else None
    if salt is None and template is None and not kwargs and named is None:
        return DEFAULT
    if template is not None:
        template = _bounded(template if isinstance(template, str) else "", MAX_TEMPLATE_CHARS)
    if not isinstance(kwargs, Mapping):  # none, or not vLLM's shape: keyed by its repr
        kwargs = {"": repr(kwargs) if _kwargs_fit(kwargs) else TOO_LONG}
    return namespace_of(model, salt, template, kwargs, named)  # type: ignore[arg-type]


def _bounded(text: str | None, limit: int) -> str | None:
    """`text` as a namespace keys it: past `limit` characters, TOO_LONG (never read)."""
    return TOO_LONG if text is not None and len(text) > limit else text


def _kwargs_fit(value: object) -> bool:
    """Whether `value` (what JSON decodes to) fits in about MAX_KWARGS_CHARS of JSON and
    MAX_KWARGS_DEPTH nested containers. The walk goes a level at a time and charges a
    container its length before it looks inside, and every item at least 2 of the
    budget, so it takes at most MAX_KWARGS_CHARS / 3 steps whatever the value's size. A
    value of another type (its repr's size unknown) does not fit."""
    budget = MAX_KWARGS_CHARS
    level = [value]
    for _ in range(MAX_KWARGS_DEPTH + 1):
        inside: list[object] = []
        for item in level:
            # Exact types (what JSON decodes to): 1.4 ms at the bound on 21,800 ints,
            # where isinstance over unions took 5.2 ms (2 busy cores).
            kind = type(item)
            if kind is str:
                budget -= len(item) + 2  # type: ignore[arg-type]
            elif kind is dict or kind is list:
                budget -= len(item) + 2  # type: ignore[arg-type]  # (commas, brackets)
                if budget < 0:
                    return False
                inside += item  # type: ignore[call-overload]  # (a dict's keys)
                if kind is dict:
                    inside += item.values()  # type: ignore[attr-defined]
            elif kind is int:
                budget -= item.bit_length() // 3 + 2  # type: ignore[attr-defined]  # (digits)
            elif item is None or kind is bool or kind is float:
                budget -= 24  # at most a float's repr
            else:
                return False
        if budget < 0:
            return False
        if not inside:
            return True
        level = inside
    return False  # nested deeper than MAX_KWARGS_DEPTH


def in_default_namespace(event: KVEvent) -> bool:
    """False for a stored block of another namespace: its hash mixed in extra keys, or
    it names a LoRA adapter."""
    if not isinstance(event, BlockStored):
        return True
    keys = event.extra_keys
    return event.lora is None and (keys is None or all(k is None for k in keys))


def prefix_of(namespace: str, on_tokens: bool) -> str | tuple[int, ...]:
    """What the tree keys go behind for `namespace` (empty for the default)."""
    if namespace == DEFAULT:
        return () if on_tokens else ""
    if on_tokens:
        digest = int(namespace, 16)
        return tuple(NS_ID_BASE + ((digest >> (16 * i)) & 0xFFFF) for i in range(ID_TAGS))
    return f"{TEXT_TAG}{namespace}\x00"


def strip(
    path: Sequence[tuple[Mapping[object, float], int]], cut: int
) -> list[tuple[Mapping[object, float], int]]:
    """A match path of `prefix + key` as one of `key`: entries inside the prefix (a
    partial match of another namespace's prefix) go, the prefix's length comes off."""
    return [(held, end - cut) for held, end in path if end > cut]
