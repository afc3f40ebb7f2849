"""Logprobs of tokens that split a UTF-8 character, rendered by `worker.http.formats` with
the tiny model's real byte-level BPE tokenizer and the sim engine's tokenizer: chat
`bytes` are each token's raw bytes (joined they rebuild the character), and completion
`text_offset`s point into `text` as the engine's detokenizer produced it."""

from __future__ import annotations

import pytest

from shared.tokens.text_tokenizer import TextTokenizer
from shared.tokens.tokenizer import Tokenizer
from worker.engine.types import GenerateOutput, TokenLogprob
from worker.http.formats import ChatFormat, Choice, CompletionFormat, Tally


@pytest.fixture(params=["tiny-bpe", "sim"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer | TextTokenizer:
    if request.param == "sim":
        return TextTokenizer()
    return Tokenizer.from_dir(request.getfixturevalue("tiny_model_dir"))


def outputs(tokenizer: Tokenizer | TextTokenizer, text: str, cut: int = 0) -> list[GenerateOutput]:
    """One streamed output per token of `text` but the last `cut`, with the text the
    engine's detokenizer gives."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[: len(ids) - cut]
    detok = tokenizer.detokenizer()
    return [
        GenerateOutput(
            "r", detok.push(i), (i,), 3, 0, k + 1, k == len(ids) - 1,
            "length" if k == len(ids) - 1 else None, 0, (TokenLogprob(i, -0.5, ((i, -0.5),)),),
        )
        for k, i in enumerate(ids)
    ]  # fmt: skip


def test_chat_bytes_of_split_tokens_join_to_the_character(tokenizer) -> None:
    outs = outputs(tokenizer, "a€b")
    assert len(outs) >= 4  # '€' is more than one token
    fmt = ChatFormat("r", "m", False, tokenizer.token_bytes)
    choice = Choice(0)
    for out in outs:
        choice.add(out)
    content = fmt.body([choice], Tally())["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == "a€b".encode()
    partial = [e for e in content if e["token"] == "\ufffd"]
    assert len(partial) == len(content) - 2  # a and b are whole; each € piece is not
    for e in partial:
        assert 1 <= len(e["bytes"]) < 3 and e["top_logprobs"][0]["bytes"] == e["bytes"]


def test_completion_offsets_index_the_text(tokenizer) -> None:
    fmt = CompletionFormat("r", "m", "hi ", False, tokenizer.token_bytes)
    outs = outputs(tokenizer, "a€b€", cut=1)  # a length stop inside the last '€'
    streamed = [c for k, out in enumerate(outs) for c in fmt.chunks(out, k == 0)]
    choices = [chunk["choices"][0] for chunk in streamed]
    text = "".join(c["text"] for c in choices)
    lps = [c["logprobs"] for c in choices]
    tokens = [t for lp in lps for t in lp["tokens"]]
    offsets = [o for lp in lps for o in lp["text_offset"]]
    # The trailing '€' is cut by the length stop: its bytes never complete, so the text
    # withholds it, while its tokens are listed (shown as U+FFFD) at the text's end.
    assert text == "hi a€b"
    assert tokens[0] == "a" and tokens[-1] == "\ufffd"
    n = (len(tokens) - 1) // 2  # tokens per '€'
    assert offsets == [3] + [4] * n + [5] + [6] * (n - 1)  # after the echo "hi " (3 chars)
    # Each whole token sits at its offset in the echoed text.
    whole = Choice(0)
    for out in outs:
        whole.add(out)
    fmt = CompletionFormat("r", "m", "hi ", False, tokenizer.token_bytes)
    body = fmt.body([whole], Tally())["choices"][0]
    assert body["text"] == text and body["logprobs"]["text_offset"] == offsets
    assert all(
        text[o : o + len(t)] == t for t, o in zip(tokens, offsets, strict=True) if t != "\ufffd"
    )
