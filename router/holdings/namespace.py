"""A request's cache namespace: what, beyond its prompt, decides which cached blocks an
engine may reuse for it. No hit is ever predicted across namespaces.

The key is the model (a LoRA adapter is served under its own `model` name, as vLLM
names them), the request's `cache_salt` (vLLM's field: a salted prompt shares blocks
only with prompts of the same salt) and, where the router renders chats (a `tokenizer`
is set), a `chat_template` or `chat_template_kwargs` the request brings: the router
renders with the model's own template, so its ids are not the ones an engine that
honours them computes. Routing on text, the router renders nothing and keys no
template (our engine ignores both fields: keyed apart, the same chat under two
`chat_template_kwargs` lost 32% of its cached tokens, loadtests/results/holdings.md).

- The default namespace of a model (no salt, the model's own template) is the empty
  string, and its keys are the plain text or ids: the fleet's view holds only workers
  that serve the request's model, so models are kept apart there, and routing where no
  namespace applies is unchanged (tests/router/policy/test_policy_equivalence.py).
- Any other namespace is a 64-bit digest of (model, salt, template), and the tree keys
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
  salted prompt's first block, a LoRA name; our engine writes the salt the same way) is
  not indexed, nor are the blocks stored below it (their parent is unknown to the
  index). A namespaced request is predicted from the tree alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from shared.wire.kv_events import BlockStored, KVEvent

DEFAULT = ""
TEXT_TAG = "\x00ns:"
NS_ID_BASE = 2**31 - 2**16  # ids from here on are namespace tags, not tokens
ID_TAGS = 4
TEXT_IN_IDS = NS_ID_BASE - 1  # leads a text key in a tree on ids (router/holdings/room.py)


def namespace_of(
    model: str | None,
    cache_salt: str | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, object] | None = None,
) -> str:
    """The request's namespace: DEFAULT where only the model applies, else a digest."""
    if cache_salt is None and chat_template is None and not template_kwargs:
        return DEFAULT
    kwargs = json.dumps(template_kwargs or {}, sort_keys=True, default=repr)
    parts = json.dumps([model or "", cache_salt, chat_template, kwargs])
    return hashlib.blake2b(parts.encode(), digest_size=8).hexdigest()


def request_namespace(parsed: object, renders: bool = True) -> str:
    """The namespace of a parsed request (shared/wire/protocol.py's models): its model,
    `cache_salt`, and where the router `renders` chats a chat's `chat_template` /
    `chat_template_kwargs` (vLLM's fields, passed through to the engine as extra fields)."""
    salt = getattr(parsed, "cache_salt", None)
    extra = (getattr(parsed, "model_extra", None) or {}) if renders else {}
    template, kwargs = extra.get("chat_template"), extra.get("chat_template_kwargs")
    if salt is None and template is None and not kwargs:
        return DEFAULT
    return namespace_of(
        getattr(parsed, "model", None), salt, str(template) if template is not None else None,
        kwargs if isinstance(kwargs, Mapping) else {"": repr(kwargs)},
    )  # fmt: skip


def in_default_namespace(event: KVEvent) -> bool:
    """False for a stored block whose hash mixed in extra keys (another namespace)."""
    keys = event.extra_keys if isinstance(event, BlockStored) else None
    return keys is None or all(k is None for k in keys)


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
