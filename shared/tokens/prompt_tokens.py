"""A request's prompt as the worker's token ids: the same code on both sides (issue 26).

The worker renders chat messages with the model's chat template and encodes the text
(`encode_prompt`); the router does the same with `PromptTokens` to look the request up
in its block index, and prompts given as token ids are used as they are.

Repeated conversation prefixes are not re-tokenized: the rendered text is cut before the
special token the template writes once per message (e.g. `<|im_start|>`), which every
tokenizer splits off before anything else, so the ids of the whole are the ids of the
pieces in order. Each piece's ids are remembered (a bounded dict), so a new turn costs
one look-up per message and the encoding of its new text only; and so are the pieces'
block keys along each conversation (shared/tokens/prompt_ids.py), so the router's block index
keys only the blocks a turn adds.
Whether that holds for a tokenizer is checked when it is loaded (a normalizer that
treats the first piece differently, e.g. SentencePiece's leading `▁`, fails the check);
where it does not, the whole text is encoded each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from shared.tokens.prompt_ids import PromptIds, Run, TokenKey

_ID_BYTES = 40  # an id in a tuple: its pointer and (past 256) its int object
_ENTRY_BYTES = 200  # a dict slot, its key tuple and a Run
_CHECK = [
    {"role": "system", "content": "You are brief. Answer in one line."},
    {"role": "user", "content": "Hello there,  world! 12 + 30 = ?"},
    {"role": "assistant", "content": " 42.\n\nAnything else?"},
    {"role": "user", "content": "No — thanks. ¿Qué tal?"},
]


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


def encode_prompt(tokenizer: Encoder, text: str) -> list[int]:
    """The worker's prompt ids for `text` (a rendered chat or a completion prompt)."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    # A chat template's output already starts with BOS; encoding adds a second one.
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


def load_tokenizer(setting: str) -> Encoder:
    """`sim`: the sim workers' built-in tokenizer; else a local model or tokenizer folder."""
    if setting == "sim":
        from shared.tokens.text_tokenizer import TextTokenizer

        return TextTokenizer()
    from shared.tokens.tokenizer import Tokenizer

    if not Path(setting, "tokenizer.json").is_file():
        raise ValueError(f"tokenizer: {setting} has no tokenizer.json (or use 'sim')")
    return Tokenizer.from_dir(setting)


class PromptTokens:
    """Prompt ids as the worker computes them, pieces and conversation prefixes cached.

    Two bounded caches, cleared together when a bound is reached (rare: a cheap bound,
    refilled by the next turns): piece text -> ids, and the conversation trie of `Run`s
    (shared/tokens/prompt_ids.py: a prefix's pieces -> its ids and block keys). Both
    belong to this tokenizer's instance: another tokenizer never reads them.

    Bounded in entries, ids and bytes (`max_bytes`: the pieces' text, 4 bytes a character
    at most, and ~40 bytes per id held): a count of ids alone let three 10 MB prompts
    leave 2.3 GB of piece text held when idle (issue 30). A piece over
    `max_bytes / 16` is encoded but never kept."""

    def __init__(
        self,
        tokenizer: Encoder,
        max_entries: int = 100_000,
        max_tokens: int = 2_000_000,
        max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_tokens = max_tokens  # ids held by both caches (~40 bytes each as ints)
        self.max_bytes = max_bytes  # what both caches hold, text and ids (estimated)
        self._bytes = 0
        self._pieces: dict[object, tuple[int, ...]] = {}
        self._runs: dict[tuple[Run | None, object], Run] = {}
        self._held = 0
        self._split = _special_split(tokenizer)
        self._lead: tuple[int, ...] = ()  # what encoding adds in front (BOS)
        self._bos = getattr(tokenizer, "bos_token_id", None)
        self.hits = self.misses = 0
        if self._split is not None and not self._pieces_agree():
            self._split = None
        self.hits = self.misses = 0

    @classmethod
    def load(cls, setting: str) -> PromptTokens:
        return cls(load_tokenizer(setting))

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    @property
    def cached(self) -> tuple[int, int, int]:
        """(pieces, runs, tokens held): what the bounds apply to (and `held_bytes`)."""
        return len(self._pieces), len(self._runs), self._held

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> PromptIds:
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt)
        return self.text(text)

    def text(self, text: str) -> PromptIds:
        """The ids, carrying their tree key and block keys (shared/tokens/prompt_ids.py);
        joined into one tuple only if read id by id."""
        if self._split is None:
            return PromptIds(encode_prompt(self.tokenizer, text))
        runs = self._runs
        run: Run | None = None
        chain: list[Run] = []
        keys: list[str] = []
        n = 0
        first, *rest = text.split(self._split)  # a literal split: C speed, no regex scan
        # Keyed by the text after each tag (the first piece, before any tag, on its own
        # key); the ids include the tag's.
        for i, piece in enumerate((first, *rest)):
            key = piece if i else ("", piece)
            got = runs.get((run, key))
            if got is None:
                got = self._run(run, key, piece)
            else:
                self.hits += 1
            run = got
            chain.append(got)
            n += len(got.ids)
            keys.append(got.key)
        # Not joined into one tuple here (PromptIds): its readers want its keys.
        key = TokenKey("".join(keys)) if got.chained else None  # split() gives >= 1 piece
        ids = PromptIds.of_runs(chain, n, key, self._grow)
        bos = self._bos
        if bos is not None and n >= 2 and _first_two(chain) == (bos, bos):
            # Only where the first run is under two ids (it drops a doubled BOS itself).
            return PromptIds(ids.flat()[1:])
        return ids

    def _run(self, parent: Run | None, key: object, piece: str) -> Run:
        """A new trie node: `piece`'s ids (from the piece cache) after `parent`."""
        ids = self._pieces.get(key)
        if ids is None:
            self.misses += 1
            whole = piece if parent is None else self._split + piece  # type: ignore[operator]
            ids = tuple(self.tokenizer.encode(whole, add_special_tokens=False))
            self._remember(self._pieces, key, ids, 4 * len(piece))
        else:
            self.hits += 1
        if parent is None:
            ids = self._lead + ids
            bos = self._bos
            # A chat template's output already starts with BOS; encoding adds a second one.
            if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
                ids = ids[1:]
        run = Run(parent, ids)
        self._remember(self._runs, (parent, key), run, 4 * len(piece))  # its key: the text
        return run

    def _remember(self, cache: dict[Any, Any], key: object, value: Any, text: int = 0) -> None:
        n = len(value.ids if isinstance(value, Run) else value)
        size = text + _ID_BYTES * n + _ENTRY_BYTES
        if size > self.max_bytes // 16:
            return  # one piece would crowd out the rest: encoded, not kept
        if (
            len(self._pieces) + len(self._runs) >= self.max_entries
            or self._held + n > self.max_tokens
            or self._bytes + size > self.max_bytes
        ):
            self._pieces.clear()
            self._runs.clear()
            self._held = self._bytes = 0
        cache[key] = value
        self._held += n
        self._bytes += size

    def _grow(self, nbytes: int) -> None:
        """Key lists the runs took on (shared/tokens/prompt_ids.py `chain_keys`): counted
        against `max_bytes` like the rest, and cleared with it."""
        if self._bytes + nbytes > self.max_bytes:
            self._pieces.clear()
            self._runs.clear()
            self._held = self._bytes = 0
        self._bytes += nbytes

    def _pieces_agree(self) -> bool:
        """Pieces encoded apart == the whole encoded, on a sample chat and a plain text."""
        tok = self.tokenizer
        plain = "Hello world"
        whole, bare = tok.encode(plain), tok.encode(plain, add_special_tokens=False)
        if whole[len(whole) - len(bare) :] != bare:
            return False  # something added at the end (EOS, SEP): not a prefix
        self._lead = tuple(whole[: len(whole) - len(bare)])
        try:
            samples = [
                tok.apply_chat_template(_CHECK, True),
                tok.apply_chat_template(_CHECK[:2], True),
            ]
        except ValueError:  # no template: completion prompts only
            samples = []
        samples += [plain, "  two leading spaces\nand lines", "x<|y|>z"]
        for sample in samples:
            if self.text(sample).tolist() != encode_prompt(tok, sample):
                return False
        self._pieces.clear()
        self._runs.clear()
        self._held = self._bytes = 0
        return True


def _special_split(tokenizer: Encoder) -> str | None:
    """A regex that cuts text just before the special token the chat template writes
    once per message (`<|im_start|>`, `<|end|>`, ...): one piece per message, each
    starting with that token, so a turn costs a dict look-up per message."""
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:  # the sim tokenizer: its template tags are `<|role|>` and `<|end|>`
        added = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    else:
        added = [t.content for t in hf.get_added_tokens_decoder().values() if t.content]
    if not added:
        return None
    try:
        sample = tokenizer.apply_chat_template(_CHECK, True)
    except ValueError:
        sample = ""
    counts = {tag: sample.count(tag) for tag in added}
    tag = max(added, key=lambda t: (counts[t], len(t)))
    if not counts[tag]:
        return None
    return tag


def _first_two(chain: Sequence[Run]) -> tuple[int, ...]:
    """The first two ids of a chain of runs (fewer where it has fewer)."""
    head: tuple[int, ...] = ()
    for run in chain:
        head += run.ids[: 2 - len(head)]
        if len(head) == 2:
            break
    return head
