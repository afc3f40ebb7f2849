"""A request's prompt as the worker's token ids: the same code on both sides (issue 26).

The worker renders chat messages with the model's chat template and encodes the text
(`encode_prompt`); the router does the same with `PromptTokens` to look the request up
in its block index, and prompts given as token ids are used as they are.

Repeated conversation prefixes are not re-tokenized: the rendered text is cut before the
special token the template writes once per message (e.g. `<|im_start|>`), which every
tokenizer splits off before anything else, so the ids of the whole are the ids of the
pieces in order. Each piece's ids are remembered (a bounded dict), and so are the runs
of pieces along each conversation (a trie), with their block keys
(shared/tokens/prompt_ids.py), so the router's block index keys only the blocks a turn
adds. A conversation's last prompt is kept as its line (its text and runs): a next turn
that starts with that text takes its runs in one comparison and splits, looks up and
encodes only the text it adds.
Whether that holds for a tokenizer is checked when it is loaded (a normalizer that
treats the first piece differently, e.g. SentencePiece's leading `▁`, fails the check);
where it does not, the whole text is encoded each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from shared.tokens.prompt_ids import PromptIds, Run, TokenKey, token_key

_ID_BYTES = 40  # an id in a tuple: its pointer and (past 256) its int object
_ENTRY_BYTES = 200  # a dict slot, its key tuple and a Run
# What names a conversation's line (`_chat_line`, `_text_line`): its first LINE_KEY
# messages or pieces (a system prompt, a first question and answer), each by its length
# and last LINE_TAIL characters. Not their whole text: a name's hash runs over all it holds
# (a 4 KB system prompt: ~2 µs a request), and a prompt takes a line's runs only where it
# starts with that line's whole text, so a name two conversations share costs a trie walk
# a turn, never a wrong run.
LINE_KEY = 3
LINE_TAIL = 256
# A line's dict slot, name, tuple and lists' heads (its text and its lists' items are
# counted apart: `PromptTokens._line`).
_LINE_BYTES = 600
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
        self._pieces: dict[object, tuple[tuple[int, ...], str]] = {}  # -> (ids, TokenKey)
        self._runs: dict[tuple[Run | None, object], Run] = {}
        # A conversation's line, by its name (`_chat_line`, `_text_line`): the last
        # prompt of that name, as (its text up to its last piece, its runs, their keys,
        # the bytes counted); cleared with the trie, whose runs it holds.
        self._lines: dict[tuple[object, ...], tuple[str, list[Run], list[str], int]] = {}
        self._cleared = 0  # times the caches were cleared (a line spans none)
        self._unkept = False  # a run of the prompt being built was not kept (too large)
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
        # A list is handed to the template as it is: a render only reads its turns (the
        # sim's, and jinja's immutable sandbox), so no copy a request.
        turns = messages if type(messages) is list else list(messages)
        text = self.tokenizer.apply_chat_template(turns, add_generation_prompt)
        if self._split is None:
            return PromptIds(encode_prompt(self.tokenizer, text))
        return self._pieced(text, _chat_line(messages))

    def text(self, text: str) -> PromptIds:
        """The ids, carrying their tree key and block keys (shared/tokens/prompt_ids.py);
        joined into one tuple only if read id by id."""
        if self._split is None:
            return PromptIds(encode_prompt(self.tokenizer, text))
        return self._pieced(text, _text_line(text, self._split))

    def _pieced(self, text: str, name: tuple[object, ...]) -> PromptIds:
        """`text`'s ids from its pieces, after the runs of its line `name` where `text`
        starts with that line's text: a conversation's next turn repeats its previous
        turn's text up to that turn's generation prompt, found in one memcmp, so only
        the text after it is split and stepped (a 40-message chat: 3 pieces, not 41)."""
        tag: str = self._split  # type: ignore[assignment]
        line = self._lines.get(name)
        if line is not None and text.startswith(line[0]):
            # The line's text ends with the tag its last piece followed, where a split of
            # the whole text finds one too (its search only ever sees what the two texts
            # share up to there), so the rest split on its own gives the whole's pieces
            # after it; and the line's runs are the trie's (kept only while all are in it,
            # but its last, which a next turn does not take: `_extend`).
            chain, keys = line[1][:-1], line[2][:-1]
            pieces = text[len(line[0]) :].split(tag)
            self.hits += len(chain)
        else:
            pieces = text.split(tag)  # a literal split: C speed, no regex scan
            chain, keys = [], []
        runs, run = self._runs, chain[-1] if chain else None
        cleared, self._unkept = self._cleared, False
        # Keyed by the text after each tag (the first piece, before any tag, on its own
        # key); the ids include the tag's. Looked up until one is not in the trie: the
        # runs after it follow a run made just now, so none of them can be.
        before = len(chain)
        for piece in pieces:
            got = runs.get((run, piece if run is not None else ("", piece)))
            if got is None:
                break
            run = got
            chain.append(got)
            keys.append(got.key)
        known = len(chain) - before  # pieces found in the trie
        self.hits += known
        if known < len(pieces):
            run = self._extend(run, pieces[known:] if known else pieces, chain, keys)
        if self._cleared == cleared and not self._unkept and len(chain) > 1:
            # Every run held by the trie (but the last): the text up to the last piece
            # names them.
            self._line(name, line, text[: len(text) - len(pieces[-1])], chain, keys)
        # Not joined into one tuple here (PromptIds): its readers want its keys.
        key = TokenKey("".join(keys)) if run.chained else None  # type: ignore[union-attr]
        ids = PromptIds.of_runs(chain, run.end, key, self._grow)  # type: ignore[union-attr]
        bos = self._bos
        if bos is not None and len(ids) >= 2 and _first_two(chain) == (bos, bos):
            # Only where the first run is under two ids (it drops a doubled BOS itself).
            return PromptIds(ids.flat()[1:])
        return ids

    def _line(
        self,
        name: tuple[object, ...],
        old: tuple[str, list[Run], list[str], int] | None,
        start: str,
        chain: list[Run],
        keys: list[str],
    ) -> None:
        """Keep a prompt's runs (all but its last in the trie) and their keys as the line
        named `name`, replacing `old` (the line of that name, if any); `start` is the
        prompt's text through the tag of its last piece (what a next turn repeats). Its
        texts and lists are counted against `max_bytes`, the line it replaces uncounted."""
        if old is not None:
            self._bytes -= old[3]
        # (Its last run's text too: the trie does not hold that run, `_extend`; its ids
        # are the piece cache's.)
        size = 4 * (len(start) + len(chain[-1].piece)) + 16 * len(chain) + _LINE_BYTES
        if size > self.max_bytes // 16:
            if old is not None:
                del self._lines[name]
            return  # as a piece that would crowd out the rest: not kept
        if self._bytes + size > self.max_bytes:
            self._clear()
            return  # its runs went with the trie
        self._lines[name] = (start, chain, keys, size)  # (replacing `old`)
        self._bytes += size

    def _extend(
        self, parent: Run | None, pieces: list[str], chain: list[Run], keys: list[str]
    ) -> Run:
        """Runs for `pieces` (a prompt's last, none in the trie) after `parent`, appended
        to `chain` (and their keys to `keys`): each piece's ids and TokenKey from the
        piece cache (a turn's generation prompt and repeated lines are keyed once, not
        once per run), or encoded. The last run made.

        Each is kept in the trie but the prompt's last where it has more than one: the
        text after its last tag (a generation prompt, a trailing newline) is what a next
        turn revises (its line ends before it), so only the same prompt again would find
        that run, and remade it costs a Run: kept, it cost the trie a node a turn."""
        cache, runs = self._pieces, self._runs
        left = len(pieces)
        for piece in pieces:
            left -= 1
            key = piece if parent is not None else ("", piece)
            got = cache.get(key)
            if got is None:
                self.misses += 1
                whole = piece if parent is None else self._split + piece  # type: ignore[operator]
                ids = tuple(self.tokenizer.encode(whole, add_special_tokens=False))
                got = (ids, token_key(ids) or "")  # "": an id that is no token id
                self._remember(cache, key, got, len(ids), 4 * len(piece))
            else:
                self.hits += 1
            ids, ids_key = got
            if parent is None:
                ids = self._lead + ids  # (the same tuple where nothing leads)
                bos = self._bos
                # A chat template's output already starts with BOS; encoding adds a second.
                if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
                    ids = ids[1:]
                if ids is not got[0]:
                    ids_key = token_key(ids) or ""
            run = Run(parent, ids, piece, ids_key)
            if left or parent is None:
                self._remember(runs, (parent, key), run, len(ids), 4 * len(piece))  # key: text
            chain.append(run)
            keys.append(ids_key)
            parent = run
        return parent  # type: ignore[return-value]

    def _remember(self, cache: dict[Any, Any], key: object, value: Any, n: int, text: int) -> None:
        """`cache[key] = value`, its `n` ids and `text` bytes counted, the caches cleared
        first where a bound would be passed (a piece too large to keep is not kept)."""
        size = text + _ID_BYTES * n + _ENTRY_BYTES
        if size > self.max_bytes // 16:
            self._unkept = True
            return  # one piece would crowd out the rest: encoded, not kept
        if (
            len(self._pieces) + len(self._runs) >= self.max_entries
            or self._held + n > self.max_tokens
            or self._bytes + size > self.max_bytes
        ):
            self._clear()
        cache[key] = value
        self._held += n
        self._bytes += size

    def _grow(self, nbytes: int) -> None:
        """Key lists the runs took on (shared/tokens/prompt_ids.py `chain_keys`): counted
        against `max_bytes` like the rest, and cleared with it."""
        if self._bytes + nbytes > self.max_bytes:
            self._clear()
        self._bytes += nbytes

    def _clear(self) -> None:
        """Both caches (and the lines through the trie) emptied: a bound was reached."""
        self._pieces.clear()
        self._runs.clear()
        self._lines.clear()
        self._cleared += 1
        self._held = self._bytes = 0

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
        self._clear()
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


def _chat_line(messages: Sequence[dict[str, Any]]) -> tuple[object, ...]:
    """A chat's line name: its first LINE_KEY messages' roles, lengths and last LINE_TAIL
    characters (a system prompt, a first question and answer), so chats on one system
    prompt keep lines of their own. Read from the messages, not the rendered text: no
    search of the text for where those messages end."""
    name: list[object] = []
    for message in messages[:LINE_KEY]:
        role, content = message.get("role"), message.get("content")
        name.append(role if type(role) is str else None)
        if type(content) is str:
            name += (len(content), content[-LINE_TAIL:])
    return tuple(name)


def _text_line(text: str, tag: str) -> tuple[object, ...]:
    """A text prompt's line name: where its first LINE_KEY pieces end and their last
    LINE_TAIL characters."""
    head = text.split(tag, LINE_KEY)
    end = len(text) - len(head[-1]) - len(tag) if len(head) > LINE_KEY else len(text)
    return "text", end, text[max(0, end - LINE_TAIL) : end]


def _first_two(chain: Sequence[Run]) -> tuple[int, ...]:
    """The first two ids of a chain of runs (fewer where it has fewer)."""
    head: tuple[int, ...] = ()
    for run in chain:
        head += run.ids[: 2 - len(head)]
        if len(head) == 2:
            break
    return head
