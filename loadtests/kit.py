"""What every command uses: help, workload options, progress lines, result tables, refs, CPU.

- `HelpFormatter`: each command's --help shows every option's default (`__main__` builds
  every parser with it); `Command`: a second command in a module.
- `WorkloadOptions`: one frozen dataclass, mapped one-to-one onto command-line flags; the
  same flags work for `locust -f loadtests/load/locustfile.py`, `python -m loadtests run`
  and `python -m loadtests simulate` (a field `prompts_per_group` is `--prompts-per-group`).
- `Progress`: one line per phase on stderr, with the time elapsed and an estimate of what
  is left (stdout keeps the results, e.g. a markdown table to paste).
- `write_table`: a benchmark's table to its `--out` file under the command that made it,
  so every number in loadtests/results/ can be rerun.
- `checkout`: `--before-ref`, the same code at another git ref in a temporary worktree, so
  a before/after ratio is measured in one session, not recalled from another day.
- `cpu_seconds`, `pct`: a process's CPU time from /proc, a nearest-rank percentile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO, get_args, get_origin, get_type_hints

ROOT = Path(__file__).resolve().parents[1]

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


@dataclass(frozen=True)
class Command:
    """A command that shares its module with the module's own one: the same pair as a
    command module's `add_arguments(parser)` and `main(args)`, with its --help text.
    COMMANDS names it "module:NAME"."""

    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    main: Callable[[argparse.Namespace], int | None]


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


# -- progress lines -------------------------------------------------------------------
#     [compare 2/3  0:21 elapsed, ~0:20 left] round_robin: running the workload
def clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Lines go to stderr and are flushed at once, so a piped or logged run shows them live."""

    def __init__(
        self, name: str, phases: int, out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.name, self.phases = name, max(1, phases)
        self.out = out or sys.stderr
        self.clock = clock
        self.started = clock()
        self.done = 0  # phases finished

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def eta(self) -> float | None:
        """Seconds left at the pace of the phases finished so far (None before the first)."""
        if not self.done:
            return None
        return self.elapsed / self.done * (self.phases - self.done)

    def say(self, text: str, left: float | None = None, step: int | None = None) -> None:
        """A line about the current phase (or `step`)."""
        left = self.eta() if left is None else left
        pace = f", ~{clock_text(left)} left" if left is not None else ""
        step = min(self.done + 1, self.phases) if step is None else step
        head = f"[{self.name} {step}/{self.phases}  {clock_text(self.elapsed)} elapsed{pace}]"
        print(f"{head} {text}", file=self.out, flush=True)

    def finished(self, text: str = "") -> None:
        """One phase done."""
        self.done += 1
        if text:
            self.say(text, step=self.done)


# -- result tables ----------------------------------------------------------------------
def write_table(out: Path, command: str, table: str, *, title: str | None = None) -> None:
    """Append `table` under `command` (the line that made it, `args.command_line` as
    `__main__` sets it); with `title`, start the file afresh with it."""
    text = f"Command: `{command}`\n\n{table}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    if title is not None:
        out.write_text(f"# {title}\n\n{text}")
    else:
        with out.open("a") as f:
            f.write(f"\n{text}")


# -- --before-ref -----------------------------------------------------------------------
@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """A temporary worktree of `ref` (a branch, tag or commit of this repository),
    detached and removed afterwards; the "before" side's processes start from it."""
    with tempfile.TemporaryDirectory(prefix="bench-ref-") as d:
        path = Path(d) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
            check=True, capture_output=True,
        )  # fmt: skip
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                check=False, capture_output=True,
            )  # fmt: skip


def short(ref: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True
    )
    return out.stdout.strip() or ref


# -- measuring --------------------------------------------------------------------------
def cpu_seconds(pid: int, *, descendants: bool = False) -> float:
    """CPU time of a process so far: its cost, whatever else competes for the cores; with
    `descendants`, plus every live descendant's (a router's worker processes).

    Read in nanoseconds, the sum of each live thread's run time
    (/proc/<pid>/task/<tid>/schedstat, first field): utime + stime from /proc/<pid>/stat
    count 10 ms ticks, so a round of 200 requests at 0.5 ms (~10 ticks) moved a ratio by
    0.1 a tick. A thread that already exited is not counted (the services keep theirs);
    where the kernel has no schedstat, the ticks are used."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            total += _process_cpu(p)
            if descendants:
                stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            if p == pid and not descendants:
                raise
    return total


def _process_cpu(pid: int) -> float:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
    except FileNotFoundError:
        if not Path(f"/proc/{pid}").exists():
            raise
    # No schedstat: utime + stime (fields 14 and 15; the command name, field 2, may hold
    # spaces: split after its closing parenthesis).
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q < 1) of `values` (not empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
