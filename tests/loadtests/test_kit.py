"""What every command shares (loadtests/kit.py): `--out` tables under the command that made
them, `args.command_line` from `__main__`, a second command in a module, CPU and quantiles."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types

import pytest

from loadtests.__main__ import COMMANDS, main
from loadtests.kit import Command, cpu_seconds, pct, write_table


def test_append_keeps_earlier_tables_and_names_each_command(tmp_path):
    out = tmp_path / "results" / "x.md"
    write_table(out, "python -m loadtests engine --batch 4", "| a |", title="Engine benchmark")
    write_table(out, "python -m loadtests host-step --steps 3", "| b |")
    write_table(out, "python -m loadtests host-step", "| c |")
    text = out.read_text()
    assert text.startswith("# Engine benchmark\n\nCommand: `python -m loadtests engine --batch 4`")
    assert "Command: `python -m loadtests host-step --steps 3`\n\n| b |\n" in text
    assert "Command: `python -m loadtests host-step`\n\n| c |\n" in text
    assert text.index("| a |") < text.index("| b |") < text.index("| c |")


def test_title_starts_the_file_afresh(tmp_path):
    out = tmp_path / "x.md"
    out.write_text("old table\n")
    write_table(out, "python -m loadtests engine", "| new |", title="T")
    assert "old table" not in out.read_text()


def test_a_command_beside_another_gets_its_own_help_and_the_line_that_started_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[argparse.Namespace] = []

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--rounds", type=int, default=3, help="how many")

    module = types.ModuleType("loadtests.load.fake")
    module.SECOND = Command("The second command: its own text.", add_arguments, seen.append)
    monkeypatch.setitem(sys.modules, "loadtests.load.fake", module)
    monkeypatch.setitem(COMMANDS, "fake", ("loadtests.load.fake:SECOND", "a fake"))
    assert main(["fake", "--rounds", "2"]) == 0
    assert seen[0].rounds == 2
    assert seen[0].command_line == "python -m loadtests fake --rounds 2"
    with pytest.raises(SystemExit):
        main(["fake", "--help"])
    shown = capsys.readouterr().out
    assert "The second command: its own text." in shown and "(default: 3)" in shown


def test_cpu_seconds_sees_less_than_a_clock_tick() -> None:
    """A 10 ms tick made a 200-request round's ratio move 0.1 a tick: the count must
    resolve a 2 ms burn (as ticks it reads 0 or 10 ms), close to the burner's own clock.
    The burner is a child with one thread, so nothing else's CPU lands in the window."""
    code = (
        "import sys, time\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "t = time.thread_time()\n"
        "while time.thread_time() - t < 0.002: pass\n"
        "print(time.thread_time() - t, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "ready\n"  # start-up done: it waits on stdin
        time.sleep(0.05)  # ... and is blocked in the read, not finishing the print
        before = cpu_seconds(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        own = float(child.stdout.readline())
        seen = cpu_seconds(child.pid) - before
        assert 0.5 * own <= seen <= own + 0.005
    finally:
        child.kill()
        child.wait()


def test_cpu_seconds_counts_this_process_and_pct_is_nearest_rank() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # burn some CPU
    assert cpu_seconds(os.getpid()) > before
    # `descendants` adds a child's CPU. The child burns 0.2 s and then idles, so the
    # difference is the child's and not this process's own clock moving between the two
    # reads (one read walks every thread's schedstat: milliseconds on a loaded machine).
    burn = "import sys,time\nt=time.process_time()\nwhile time.process_time()-t<0.2: pass\n"
    child = subprocess.Popen(
        [sys.executable, "-c", burn + "print(flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE
    )
    try:
        child.stdout.readline()  # the burn is done
        own = cpu_seconds(os.getpid())
        both = cpu_seconds(os.getpid(), descendants=True)
        assert both - own >= 0.15
    finally:
        child.kill()
        child.wait()
    with pytest.raises(FileNotFoundError):
        cpu_seconds(2**22 + 12345)  # no such process
    values = [float(v) for v in range(1, 101)]
    assert pct(values, 0.5) == 51.0 and pct(values, 0.99) == 100.0 and pct([7.0], 0.9) == 7.0
