"""Every command in README.md works as written.

The README's fenced blocks are read in order:

- `bash` blocks: each line is a command (`#` lines are comments, a trailing `\\` joins
  lines). A command is split at ` && ` into steps. Install steps (`python3 -m venv`,
  `. .venv/bin/activate`, `pip install ...`) and the test command (`python -m pytest`)
  are what CI runs: `.ci/run` must hold each of them verbatim. `radix-router up ...` is
  started once, in the background, and every other step runs against its fleet.
- `python` blocks run as scripts against the same fleet.
- any other block (`text`, none) is not run: that is where commands go that no test can
  run here (a GPU, a cluster, the network).

Every step runs in the repository root with `radix-router`, `radix-worker`, `python` and
`locust` resolving to this checkout and this interpreter, and with the router's port 8000
swapped for a free one. A step fails the test on a non-zero exit or an error line in
its output (a traceback, `error:`, an `ERROR` log line, `SomethingError: ...`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
README_PORT = "8000"
SETUP = ("python3 -m venv ", ". .venv/bin/activate", "pip install ")
SUITE = "python -m pytest"
UP = "radix-router up"
STEP_TIMEOUT_S = 240
UP_TIMEOUT_S = 300
ERROR_LINE = re.compile(
    r"^\s*(Traceback \(most recent call last\)|error:|ERROR\b|\w+(Error|Exception): )"
    r"|[ /]ERROR[ /:]"
)


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int  # where the block starts in README.md, for messages


def blocks(markdown: str) -> list[Block]:
    out = []
    for m in re.finditer(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", markdown, re.MULTILINE | re.DOTALL):
        out.append(Block(m[1], m[2], markdown.count("\n", 0, m.start()) + 1))
    return out


def commands(bash: str) -> list[str]:
    """The command lines of a bash block: continuations joined, comments dropped."""
    joined = re.sub(r"[ \t]*\\\n\s*", " ", bash)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]


def steps(command: str) -> list[str]:
    return [s.strip() for s in command.split(" && ")]


def kind(step: str) -> str:
    if step.startswith(SETUP):
        return "setup"
    if step.startswith(SUITE):
        return "suite"
    if step.startswith(UP):
        return "up"
    return "run"


def error_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if ERROR_LINE.search(line)]


# -- the parser, on a README of its own ----------------------------------------------
SAMPLE = """# t
```bash
# comment
python3 -m venv .venv && pip install -e '.[dev]' && radix-router up --workers 2
python -m loadtests run --host http://127.0.0.1:8000 \\
    --users 4
```
```text
nvidia-smi
```
```python
print("hi")
```
"""


def test_blocks_commands_and_steps_are_read_as_documented() -> None:
    found = blocks(SAMPLE)
    assert [(b.lang, b.line) for b in found] == [("bash", 2), ("text", 8), ("python", 11)]
    cmds = commands(found[0].text)
    assert cmds == [
        "python3 -m venv .venv && pip install -e '.[dev]' && radix-router up --workers 2",
        "python -m loadtests run --host http://127.0.0.1:8000 --users 4",
    ]
    assert [kind(s) for s in steps(cmds[0])] == ["setup", "setup", "up"]
    assert kind(cmds[1]) == "run"


def test_error_lines_are_found_and_tables_are_not() -> None:
    bad = "ok\nTraceback (most recent call last):\n  x\nValueError: no\n"
    assert error_lines(bad) == ["Traceback (most recent call last):", "ValueError: no"]
    assert error_lines("error: port 8000 is taken")
    assert error_lines("[2026-01-01 00:00:00,000] host/ERROR/locust.runners: boom")
    assert error_lines("2026-01-01 00:00:00 ERROR router: boom")
    clean = "| policy | failures |\nError report\n# occurrences      Error\n0 errors\n"
    assert error_lines(clean) == []


def test_ci_runs_every_install_step_and_the_test_command() -> None:
    ci = CI.read_text()
    ci_lines = {line.strip() for line in ci.splitlines()}
    wanted = [
        s
        for b in blocks(README.read_text())
        if b.lang == "bash"
        for c in commands(b.text)
        for s in steps(c)
        if kind(s) in ("setup", "suite")
    ]
    assert wanted, "the README's two commands are gone"
    missing = [s for s in wanted if s not in ci_lines and not any(s in line for line in ci_lines)]
    assert missing == [], f".ci/run does not run these README steps verbatim: {missing}"


# -- running it ---------------------------------------------------------------------
@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """`radix-router`, `radix-worker`, `python`, `locust`: this checkout, this interpreter."""
    d = tmp_path / "bin"
    d.mkdir()
    shims = {
        "radix-router": "-m router",
        "radix-worker": "-m worker",
        "python": "",
        "python3": "",
        "locust": "-m locust",
    }
    for name, args in shims.items():
        script = d / name
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        script.chmod(0o755)
    return d


@dataclass
class Runner:
    env: dict[str, str]
    port: int
    up: subprocess.Popen[str] | None = None
    up_output: str = ""

    def localize(self, text: str) -> str:
        for host in ("127.0.0.1", "localhost"):
            text = text.replace(f"{host}:{README_PORT}", f"{host}:{self.port}")
        return text

    def run(self, label: str, argv: list[str]) -> None:
        done = subprocess.run(
            argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
        output = done.stdout + done.stderr
        errors = error_lines(output)
        assert done.returncode == 0 and not errors, (
            f"{label}\nexit {done.returncode}, error lines {errors}\n{output[-4000:]}"
        )

    def start_up(self, step: str) -> None:
        assert self.up is None, "the README starts `radix-router up` more than once"
        argv = [*shlex.split(step), "--port", str(self.port)]  # the last --port wins
        self.up = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        assert self.up.stdout is not None
        deadline = time.monotonic() + UP_TIMEOUT_S
        lines: list[str] = []
        while time.monotonic() < deadline:
            line = self.up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        self.up_output = "".join(lines)
        assert "Press Ctrl-C" in self.up_output, f"{step}\n{self.up_output[-4000:]}"
        assert not error_lines(self.up_output), self.up_output

    def stop_up(self) -> None:
        if self.up is None:
            return
        self.up.send_signal(signal.SIGINT)
        try:
            code = self.up.wait(60)
        finally:
            if self.up.poll() is None:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait()
        rest = self.up.stdout.read() if self.up.stdout else ""
        assert code == 0, f"`radix-router up` exited {code} on Ctrl-C\n{rest[-3000:]}"


@pytest.fixture
def runner(bin_dir: Path) -> Iterator[Runner]:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(ROOT)
    r = Runner(env, free_port())
    try:
        yield r
    finally:
        if r.up is not None and r.up.poll() is None:
            r.up.send_signal(signal.SIGINT)
            try:
                r.up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(r.up.pid, signal.SIGKILL)
                r.up.wait()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_readme_command_runs_as_written(runner: Runner) -> None:
    todo: list[tuple[str, list[str]]] = []  # (label, argv), run once the fleet is up
    for b in blocks(README.read_text()):
        if b.lang == "python":
            todo.append(
                (f"README.md:{b.line} (python)", [sys.executable, "-c", runner.localize(b.text)])
            )
            continue
        if b.lang != "bash":
            continue
        for command in commands(b.text):
            for step in steps(command):
                k = kind(step)
                if k == "up":
                    runner.start_up(step)
                elif k == "run":
                    label = f"README.md:{b.line}: {step}"
                    todo.append((label, ["bash", "-eo", "pipefail", "-c", runner.localize(step)]))
    assert runner.up is not None, "the README no longer starts a fleet with `radix-router up`"
    for label, argv in todo:
        runner.run(label, argv)
    runner.stop_up()
