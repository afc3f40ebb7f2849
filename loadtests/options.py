"""Workload options: one frozen dataclass, mapped one-to-one onto command-line flags.

The same flags work for `locust -f loadtests/load/locustfile.py`, `python -m loadtests run`
and `python -m loadtests simulate`: a field `prompts_per_group` is `--prompts-per-group`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

WORKLOADS = ("shared_prefix", "multi_turn", "rag", "mooncake")
DEFAULT_TRACE = str(Path(__file__).parent / "traces" / "mooncake_synthetic_trace.jsonl")


@dataclass(frozen=True)
class WorkloadOptions:
    workload: Literal["shared_prefix", "multi_turn", "rag", "mooncake"] = "shared_prefix"
    seed: int = 0
    # shared_prefix (SGLang's defaults); system_len also sizes multi_turn's shared system prompt.
    groups: int = 64
    prompts_per_group: int = 16
    system_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    # shared_prefix skew: 0 gives every group `prompts_per_group` questions; above 0 the
    # same number of requests picks its group Zipf-like with this exponent (hot prefixes).
    group_zipf: float = 0.0
    # multi_turn
    conversations: int = 64
    turns: int = 8
    # rag
    docs: int = 256
    doc_len: int = 512
    docs_per_request: int = 3
    rag_requests: int = 1024
    zipf: float = 1.1
    # mooncake
    trace: str = DEFAULT_TRACE
    block_words: int = 32
    trace_limit: int | None = None
    arrival: Literal["trace", "asap"] = "trace"
    speedup: float = 1.0
    max_output: int | None = None
    # all: start over when the requests run out (a time-bounded run) instead of stopping
    loop: bool = False

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be >= 0, got {v}")
        if self.speedup <= 0 or self.block_words < 1 or self.groups < 1 or self.conversations < 1:
            raise ValueError("speedup, block_words, groups and conversations must be positive")


# One line per option for --help: what it is and its unit. A "word" of the generated
# text is meant to be about one token (a random Llama tokenizer splits it into ~4).
HELP: dict[str, str] = {
    "workload": "traffic shape",
    "seed": "random seed of the generated requests",
    "groups": "shared_prefix: system prompts (groups of requests sharing one)",
    "prompts_per_group": "shared_prefix: questions per system prompt",
    "system_len": "shared_prefix and multi_turn: system prompt length, in words",
    "question_len": "question length, in words",
    "output_len": "max_tokens of each request, in tokens",
    "group_zipf": "shared_prefix: Zipf exponent of group popularity (0: equal groups)",
    "conversations": "multi_turn: conversations (each kept by one user)",
    "turns": "multi_turn: turns per conversation",
    "docs": "rag: documents in the pool",
    "doc_len": "rag: document length, in words",
    "docs_per_request": "rag: documents cited per request",
    "rag_requests": "rag: requests in the workload",
    "zipf": "rag: Zipf exponent of document popularity",
    "trace": "mooncake: trace file (JSON lines)",
    "block_words": "mooncake: words per 512-token block of the trace",
    "trace_limit": "mooncake: replay only the first N trace lines",
    "arrival": "mooncake: trace timestamps, or every request as soon as possible",
    "speedup": "mooncake: replay this many times faster than the trace",
    "max_output": "mooncake: cap on each request's output, in tokens",
    "loop": "start over when the requests run out (implied by a --run-time)",
}


def _shown(default: object) -> bool:
    # `is`, not `in`: 0 == False, and a default of 0 is worth showing.
    return not any(default is x for x in (None, False, argparse.SUPPRESS)) and default != ""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: the description as written, and each option's default
    after its help unless the help already names it (switches and unset ones excepted)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and _shown(action.default):
            action = copy.copy(action)  # argparse prints nothing for an option without help
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or "%(" in text or not action.option_strings:
            return text
        if not _shown(action.default):
            return text
        return f"{text} (default: %(default)s)".strip()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_workload_arguments(
    parser: Any, env: bool = False, defaults: dict[str, Any] | None = None
) -> None:
    """Add one flag per option. `env=True` (locust's configargparse parser) also reads
    LOCUST_<NAME> environment variables; `defaults` replaces some defaults (and their
    help) for one command."""
    hints = get_type_hints(WorkloadOptions)
    for f in dataclasses.fields(WorkloadOptions):
        default = (defaults or {}).get(f.name, f.default)
        kwargs: dict[str, Any] = {
            "default": default,
            "help": f"{HELP[f.name]} (default: {default})",
        }
        if env:
            kwargs["env_var"] = "LOCUST_" + f.name.upper()
        hint = hints[f.name]
        if f.name == "loop":
            kwargs["action"] = "store_true"
        elif get_origin(hint) is Literal:
            kwargs["choices"] = get_args(hint)
        else:
            # int | None parses as int; the scalar type is the first non-None member.
            kwargs["type"] = next(t for t in (get_args(hint) or (hint,)) if t is not type(None))
        parser.add_argument(_flag(f.name), **kwargs)


def options_from_namespace(ns: argparse.Namespace | Any) -> WorkloadOptions:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(WorkloadOptions)}
    return WorkloadOptions(**values)


def options_to_argv(options: WorkloadOptions) -> list[str]:
    """Flags that rebuild `options` on another process's command line (defaults omitted)."""
    argv: list[str] = []
    for f in dataclasses.fields(WorkloadOptions):
        v = getattr(options, f.name)
        if v == f.default:
            continue
        if f.name == "loop":
            argv.append(_flag(f.name))
        else:
            argv += [_flag(f.name), str(v)]
    return argv
