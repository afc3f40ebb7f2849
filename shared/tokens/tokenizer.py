"""Tokenizer: HF `tokenizers` for text ⇄ ids, jinja2 for chat templates.

Reads `tokenizer.json` (the fast tokenizer: normalizer, pre-tokenizer, model,
post-processor, decoder) and `tokenizer_config.json` (bos/eos tokens,
`add_bos_token`, `chat_template`), plus `chat_template.jinja` (where transformers 5
saves the template) and `generation_config.json` (extra eos ids). transformers is
not needed at run time; the tests check that the results equal its.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

BATCH_CHARS = 256  # longer texts: encoded without the GIL and the offsets (`encode`)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config spells a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (char -> byte): byte-level BPE vocabularies
    spell every byte as one printable char (printable Latin-1 as itself, the rest as
    U+0100 + n), so a token's raw bytes are its vocab string mapped back through this."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in printable)
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


_BYTE_LEVEL = _byte_level_table()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers some templates
    carry): rendered as its body, as transformers does when not tracking masks."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's API)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes; chat templates expect plain JSON (as transformers).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# Every name `getattr` finds on a plain dict: its type's and object's (a dict instance
# carries no attributes of its own, and the builtin types cannot be changed).
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, reading `message.role` on a message dict without the detour.

    `SandboxedEnvironment.getattr` tries the attribute first and reads the item after its
    AttributeError: ~1 µs a read, and Qwen2.5's template reads `message.role` / `.content`
    ~4 times a message (a 40-message chat of `router-tokens`: 176 -> 68 µs a render, with
    the globals' copy below). On a plain dict and a name that is no attribute of a dict,
    that detour always fails, so the item is read directly: the result is the one the
    detour reaches (the item, or the same Undefined). Anything else (a dict method such
    as `items`, a dict subclass, a name not a plain str) takes jinja2's own path."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


class ChatTemplate:
    """A chat template compiled the way transformers compiles it: sandboxed, with
    trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now` and a plain `tojson`."""

    def __init__(self, source: str) -> None:
        env = _ChatEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not compile: {e}") from e
        # Every render copies the globals into its context: from jinja2's ChainMap (the
        # template's over the environment's) that copy is a Python loop, ~7 of the ~13 µs
        # a one-message render costs; from a dict, one copy in C. Same names, same values
        # (the environment's globals are set above, before this, and never after).
        self._template.globals = dict(self._template.globals)

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects with 'role' and 'content'")
        try:
            return self._template.render(messages=messages, **variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Never emits half a UTF-8 character: byte-level BPE splits emoji and accented
    letters across tokens, so a delta is held back until its bytes decode (the Rust
    `DecodeStream` does the bookkeeping over a sliding window of ids).
    """

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The new text this token completes ("" while a character is still partial)."""
        return self._stream.step(self._tokenizer, int(token_id)) or ""


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = self._id_of(bos_token)
        eos_ids = [self._id_of(eos_token), *extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in eos_ids if i is not None)
        )
        # None: trust tokenizer.json's post-processor (how PreTrainedTokenizerFast works);
        # True: make sure BOS is there (LlamaTokenizerFast's `add_bos_token`).
        self._add_bos_token = add_bos_token
        self._template = ChatTemplate(chat_template) if chat_template else None
        # Every special token the template may name (bos_token, eos_token, pad_token, ...).
        self._special_tokens = dict(special_tokens or {})
        self._special_tokens.setdefault("bos_token", bos_token or "")
        self._special_tokens.setdefault("eos_token", eos_token or "")
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self._byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self._bytes: dict[int, bytes] = {}  # token id -> raw bytes, filled on first use
        # tokenizers >= 0.20 has the `_fast` form: the ids of `encode_batch`
        # (tests/worker/engine/test_tokenizer.py)
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir} (only fast tokenizers are supported)"
            )
        tokenizer = HFTokenizer.from_file(str(tok_path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        template = (
            template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        )
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        gen_eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        extra_eos = (
            gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        )
        special = {
            key: content
            for key in (
                "bos_token",
                "eos_token",
                "unk_token",
                "pad_token",
                "sep_token",
                "cls_token",
                "mask_token",
            )
            if (content := _token_content(cfg.get(key))) is not None
        }
        return cls(
            tokenizer,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            add_bos_token=cfg.get("add_bos_token"),
            chat_template=template,
            extra_eos_token_ids=[int(i) for i in extra_eos],
            special_tokens=special,
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's embedding may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def longest_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary spelling's length
        (byte-level BPE spells each byte as one character; a decoded token has no more
        characters than bytes). A text longer than n × this has more than n tokens."""
        return max((len(t) for t in self._tok.get_vocab()), default=1)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if len(text) > BATCH_CHARS:
            # `encode_batch` releases the GIL while it works (`encode` holds it: 1.6 s
            # for 560k characters with another thread frozen); same ids. The router
            # tokenizes long prompts on a thread (router/http/tokenize.py), so its event
            # loop runs meanwhile. Its `_fast` form skips the character offsets, which
            # nothing here reads: CPU a call, tiny BPE, calls spaced 0.5 ms apart as
            # requests are, 200 / 2,000 / 4,000 characters: 87 -> 77 / 550 -> 405 /
            # 1,070 -> 790 µs. Not for short texts: a batch is handed to the `tokenizers`
            # thread pool, which costs about what the offsets do at 40 characters.
            enc = self._encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        ids: list[int] = enc.ids
        if (
            add_special_tokens
            and self._add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's own raw UTF-8 bytes (OpenAI's logprob `bytes`): a byte-level BPE
        token may hold part of a character, which `decode([id])` would turn into U+FFFD;
        these bytes, joined over consecutive tokens, rebuild it."""
        out = []
        for i in ids:
            raw = self._bytes.get(int(i))
            if raw is None:
                raw = self._bytes[int(i)] = self._raw_bytes(int(i))
            out.append(raw)
        return out

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:  # an id past the vocabulary (padded embedding rows)
            return b""
        if token_id in self._added_ids:  # added/special tokens are stored as plain text
            return piece.encode()
        if self._byte_level:
            # As the Rust ByteLevel decoder: map every char back, or (some char outside
            # the table) take the piece's own UTF-8.
            if all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            return piece.encode()
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes((int(m.group(1), 16),))
        # Other decoders (Metaspace, WordPiece) only produce whole characters per token.
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's template (ValueError if it has none or
        the template rejects the conversation)."""
        if self._template is None:
            raise ValueError(
                "this model's tokenizer has no chat template; use the completions API "
                "with a plain prompt instead"
            )
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, **self._special_tokens, **kwargs
        )
