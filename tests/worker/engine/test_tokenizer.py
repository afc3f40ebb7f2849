"""Tokenizer and chat template against transformers; the tiny model maker's outputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import FunctionType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.tokens.tokenizer import _DICT_ATTRIBUTES, BATCH_CHARS, Tokenizer, _ChatEnvironment
from worker.cli import main
from worker.models.tiny_model import PRESETS

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The cat sees a red ball today.",
    "  leading spaces and\ttabs\nnew lines  ",
    "Café au lait, naïve façade, Ærøskøbing — “quotes”",
    "Emoji 🙂🚀👩‍👩‍👧 and CJK 你好世界, Hindi नमस्ते",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "two"}],
        }
    ],
]


@pytest.fixture(scope="module")
def ours(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def theirs(tiny_model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def test_special_tokens_and_vocab(ours: Tokenizer, theirs) -> None:
    assert ours.bos_token_id == theirs.bos_token_id == 0
    assert ours.eos_token_ids == (1, 3)  # tokenizer eos, then generation_config's extra
    assert ours.vocab_size == len(theirs) == 1024


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[0] == ours.bos_token_id
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


# Texts around and past BATCH_CHARS (encoded in a batch, without offsets): words, the
# texts above, special tokens inside the text, any characters.
LONG_TEXTS = st.lists(
    st.one_of(
        st.sampled_from([*TEXTS, "<|im_start|>", "<|im_end|>\n", " the model", "  "]),
        st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60),
    ),
    max_size=80,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=LONG_TEXTS)
def test_texts_of_any_length_encode_as_transformers_does(
    ours: Tokenizer, theirs, text: str
) -> None:
    """Short texts are encoded one way, long ones another (`Tokenizer.encode`): both give
    transformers' ids, with and without special tokens."""
    longer = text * (BATCH_CHARS // max(len(text), 1) + 1)  # past BATCH_CHARS (or "")
    for sample in (text, longer):
        assert ours.encode(sample) == theirs.encode(sample)
        assert ours.encode(sample, add_special_tokens=False) == theirs.encode(
            sample, add_special_tokens=False
        )


def test_long_texts_are_encoded_in_a_batch(ours: Tokenizer, theirs) -> None:
    text = (TEXTS[2] + " " + TEXTS[3] + " ") * (BATCH_CHARS // 40)
    assert len(text) > BATCH_CHARS and len(ours.encode(text)) > 100
    assert ours.encode(text) == theirs.encode(text)


def test_common_words_are_single_tokens(ours: Tokenizer) -> None:
    # The BPE was trained: frequent corpus words do not fall apart into bytes.
    assert len(ours.encode(" the model", add_special_tokens=False)) == 2


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer,
    theirs,
    messages: list[dict],
    add_generation_prompt: bool,
) -> None:
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert got == want
    assert got.startswith("<|begin_of_text|><|im_start|>")
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_prompt_encodes_to_chatml_specials(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = ours.encode(text, add_special_tokens=False)
    assert ids[:2] == [0, 2]  # <|begin_of_text|><|im_start|>: specials stay single tokens
    assert 3 in ids  # <|im_end|>


def _with_template(tiny_model_dir: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the tiny model whose tokenizer config carries `template`."""
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model_dir


def test_template_features_transformers_provides(tiny_model_dir: Path, tmp_path: Path) -> None:
    """raise_exception, tojson without HTML escaping, loop controls, eos_token."""
    model_dir = _with_template(tiny_model_dir, tmp_path, (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}\n"
        "{% endfor %}{{ eos_token }}"
    ))  # fmt: skip
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": f"<b>{i}</b> é"} for i in range(4)]
    got = ours.apply_chat_template(messages)
    assert got == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '"<b>0</b> é"' in got
    assert got.endswith("<|end_of_text|>")
    with pytest.raises(ValueError, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_render_sees_the_globals_transformers_provides(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The template's globals are copied into a dict once (ChatTemplate): jinja2's own
    (range, namespace, dict, ...) and transformers' (strftime_now, raise_exception) are
    all there, as transformers has them."""
    model_dir = _with_template(tiny_model_dir, tmp_path, (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m['content'] }}{% endfor %}{{ ns.n }} {{ range(3) | list }} {{ dict(a=1) }} "
        "{{ strftime_now('%Y') | length }} {{ cycler is defined }} {{ joiner is defined }}"
        "{% if messages | length > 2 %}{{ raise_exception('too many') }}{% endif %}"
    ))  # fmt: skip
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    got = ours.apply_chat_template(messages)
    assert got == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == "ab2 [0, 1, 2] {'a': 1} 4 True True"
    with pytest.raises(ValueError, match="too many"):
        ours.apply_chat_template(messages * 2)


# Qwen2.5's style: `message.role` (attribute syntax on dicts), tool calls and responses,
# `loop` and `messages[...]`, a default system prompt.
QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n' + tool_call.name + ' ' }}{{- tool_call.arguments | tojson }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>' + message.content }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{{- message.items() | list | length }}"
    "{{- message.get('name', '') }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
MESSAGE = st.one_of(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "user", "assistant", "tool"]),
        WORDS,
    ),
    st.builds(
        lambda content, name, args, nested: {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"function": {"name": name, "arguments": args}}
                if nested
                else {"name": name, "arguments": args}
            ],
        },
        WORDS,
        WORDS,
        st.dictionaries(WORDS, WORDS, max_size=2),
        st.booleans(),
    ),
    st.builds(
        lambda content, name: {"role": "user", "content": content, "name": name}, WORDS, WORDS
    ),
)


def test_a_template_in_qwens_style_renders_as_transformers_does(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`message.role` on a dict takes a shorter path than jinja2's (_ChatEnvironment):
    random conversations render to transformers' text."""
    model_dir = _with_template(tiny_model_dir, tmp_path, QWEN_STYLE)
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)

    @settings(max_examples=80, deadline=None)
    @given(messages=st.lists(MESSAGE, min_size=1, max_size=6), prompt=st.booleans())
    def check(messages: list[dict], prompt: bool) -> None:
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == want

    check()


class _Dict(dict):
    role = "an attribute"


NAMES = st.one_of(
    st.sampled_from(
        [
            "role",
            "content",
            "tool_calls",
            "items",
            "get",
            "keys",
            "pop",
            "update",
            "__class__",
            "__dict__",
            "__len__",
            "_private",
            "mro",
            "format",
            "upper",
            "function",
        ]
    ),
    st.text(max_size=6),
)
OBJECTS = st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.dictionaries(NAMES, inner, max_size=4),
        st.dictionaries(NAMES, inner, max_size=4).map(_Dict),
        st.lists(inner, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(obj=OBJECTS, name=st.one_of(NAMES, st.integers()))
def test_chat_environment_reads_attributes_as_jinjas_sandbox_does(obj: object, name: str) -> None:
    """`_ChatEnvironment.getattr` == `ImmutableSandboxedEnvironment.getattr` on any object
    and name: the same value, or the same Undefined (name, object, hint), or the same
    error."""
    ours, theirs = _ChatEnvironment(), ImmutableSandboxedEnvironment()

    def read(env: ImmutableSandboxedEnvironment) -> object:
        try:
            return env.getattr(obj, name)
        except Exception as e:  # compared below
            return type(e)

    got, want = read(ours), read(theirs)
    if isinstance(want, Undefined):
        assert type(got) is type(want)
        assert got._undefined_name == want._undefined_name  # type: ignore[union-attr]
        assert got._undefined_obj is want._undefined_obj  # type: ignore[union-attr]
        assert got._undefined_hint == want._undefined_hint  # type: ignore[union-attr]
    elif isinstance(want, FunctionType):
        # A string's `format` through the sandbox: a new wrapper function each read (never
        # equal to another), so compared by name and by what a call of it gives.
        assert isinstance(got, FunctionType) and got.__name__ == want.__name__

        def call(f: FunctionType) -> object:
            try:
                return f("x")
            except Exception as e:
                return type(e)

        assert call(got) == call(want)
    else:
        assert got == want


def test_the_names_a_dict_has_as_attributes() -> None:
    candidates = {*_DICT_ATTRIBUTES, "role", "content", "__dict__", "__weakref__", "mro", ""}
    for name in candidates:
        assert hasattr({}, name) == (name in _DICT_ATTRIBUTES), name


def test_missing_chat_template_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(model_dir)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tiny_model_dir: Path, tmp_path: Path) -> None:
    """transformers 5 saves the template as chat_template.jinja."""
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert (
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "u", "content": "hi"}]) == "HI"
    )


def test_bad_messages_are_value_errors(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match="list of objects"):
        ours.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chat template"):
        ours.apply_chat_template([{"content": "no role"}])


@pytest.mark.parametrize("text", TEXTS[2:4])
def test_incremental_detokenizer_equals_full_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    detok = ours.detokenizer()
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == ours.decode(ids) == text
    # No delta ever carries a broken character.
    assert not any("\ufffd" in d for d in deltas)
    # Multi-byte characters span several byte-level tokens, so some steps emit nothing.
    assert "" in deltas


def test_detokenizer_skips_special_tokens(ours: Tokenizer) -> None:
    text = ours.apply_chat_template([{"role": "user", "content": "hi 🙂"}])
    ids = ours.encode(text, add_special_tokens=False)
    detok = ours.detokenizer()
    assert "".join(detok.push(i) for i in ids) == ours.decode(ids) == "user\nhi 🙂\nassistant\n"


def test_token_bytes_rebuild_characters_split_across_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("5€", add_special_tokens=False)
    raw = ours.token_bytes(ids)
    euro = [r for r in raw if not r.isascii()]
    # The tiny BPE splits '€' (E2 82 AC) into byte tokens: each alone is no character,
    # which is why decode([id]) shows U+FFFD and OpenAI's `bytes` field exists.
    assert len(euro) >= 2 and all(ours.decode([i]) == "\ufffd" for i in ids[-len(euro) :])
    assert b"".join(euro) == "€".encode() and b"".join(raw) == b"5\xe2\x82\xac"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(ids)) == text.encode()


def test_token_bytes_agree_with_decode_for_every_whole_token(ours: Tokenizer) -> None:
    whole = 0
    for i in range(ours.vocab_size):
        (raw,) = ours.token_bytes([i])
        text = ours.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert raw == text.encode(), i
            whole += 1
        else:
            assert raw.decode("utf-8", errors="replace") == text, i
    assert whole > ours.vocab_size // 2
    assert ours.token_bytes([ours.eos_token_ids[0]]) == [b"<|end_of_text|>"]


def test_make_tiny_model_cli_and_transformers_load(tmp_path: Path) -> None:
    assert (
        main(["make-tiny-model", str(tmp_path / "q"), "--arch", "qwen2", "--num-shards", "2"]) == 0
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings
    assert (
        transformers.AutoTokenizer.from_pretrained(tmp_path / "q").bos_token == "<|begin_of_text|>"
    )
    assert PRESETS["bench"]["hidden_size"] == 512 and PRESETS["bench"]["num_layers"] == 8
    # A preset's shape with flags on top: a one-layer Qwen3.
    argv = ["make-tiny-model", str(tmp_path / "q3"), "--preset", "tiny", "--arch", "qwen3"]
    assert main([*argv, "--layers", "1", "--heads", "4", "--kv-heads", "2"]) == 0
    q3 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q3")
    assert type(q3).__name__ == "Qwen3ForCausalLM" and q3.config.num_hidden_layers == 1


def test_folder_resaved_by_transformers_loads_the_same(
    ours: Tokenizer, theirs, tmp_path: Path
) -> None:
    """transformers 5 writes chat_template.jinja and a different tokenizer_config."""
    theirs.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    resaved = Tokenizer.from_dir(tmp_path)
    messages = CONVERSATIONS[1]
    assert resaved.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert resaved.encode(TEXTS[3]) == ours.encode(TEXTS[3])
    assert resaved.bos_token_id == ours.bos_token_id
