"""`radix-router up`: a whole local fleet starts, serves, and stops leaving nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from loadtests.load.cluster import ROOT
from router.cli import build_parser, serve_config
from router.up.preflight import StartError, check_prerequisites
from shared.config import ConfigError
from shared.procs import http_json, wait_until
from shared.redis_server import free_port

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_flags_become_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9",
            "--policy",
            "round_robin",
            "--worker-url",
            "http://127.0.0.1:1",
            "--worker-url",
            "http://127.0.0.1:2",
        ]
    )
    config = serve_config(args)
    assert config.port == 9 and config.policy == "round_robin"
    assert config.worker_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    with pytest.raises(ConfigError, match="worker_urls"):
        serve_config(build_parser().parse_args(["serve", "--worker-url", "ftp://x"]))


def test_up_starts_a_fleet_and_sigint_leaves_nothing_running() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [sys.executable, "-m", "router", "up", "--workers", "2", "--engine", "sim", "--port", str(port),
         "--start-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 90
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                break
        output = "".join(lines)
        assert f"Router ready at http://127.0.0.1:{port}" in output, output
        assert "model:     sim" in output and f"http://127.0.0.1:{port}/dashboard" in output
        log_dir = Path(re.findall(r"logs in (\S+) \(removed on a clean exit\)", output)[0])
        assert (log_dir / "router.log").exists()
        assert len(re.findall(r"worker-\d \(pid \d+\) starting", output)) == 2
        body = json.dumps({"prompt": "hello from up", "max_tokens": 3}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
        children = descendants(up.pid)
        assert len(children) >= 4  # redis, 2 workers, router
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        wait_until(lambda: not any(alive(pid) for pid in children), 10)  # they were alive above
        assert not log_dir.exists()
    finally:
        if up.poll() is None:
            for pid in descendants(up.pid):
                os.kill(pid, signal.SIGKILL)
            up.kill()
            up.wait()


def test_up_on_a_taken_port_fails_with_one_line_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-m", "router", "up", "--engine", "sim", "--port", str(port)],
            capture_output=True, cwd=ROOT, env=env, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 1
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: port {port} on 127.0.0.1 is taken")
    assert list(tmp_path.iterdir()) == []  # not even a log folder was made


def test_missing_pieces_are_named_before_anything_starts() -> None:
    def without(*missing: str):
        return lambda name: None if name in missing else object()

    check_prerequisites("radix", None, without())
    torch_line = r"--engine radix needs torch: pip install torch==2\.13\.0 --index-url"
    with pytest.raises(StartError, match=torch_line):
        check_prerequisites("radix", None, without("torch"))
    check_prerequisites("sim", None, without("torch"))  # sim runs without torch
    with pytest.raises(StartError, match="worker package is not installed"):
        check_prerequisites("sim", "redis://127.0.0.1:1/0", without("worker"))


def test_up_restarts_a_killed_worker_while_the_fleet_keeps_serving() -> None:
    """Was: one worker dying ended `up` (exit 1) with a log tail cut mid-line. Now the
    exit is one line, the router routes around it, and the worker comes back on its
    port with a new epoch (an empty cache) and is routed to again."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [sys.executable, "-m", "router", "up", "--workers", "2", "--engine", "sim", "--port", str(port),
         "--start-timeout", "60", "--policy", "round_robin"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True
    )  # type: ignore[union-attr]
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any("Press Ctrl-C" in ln for ln in lines) or up.poll() is not None, 90)
        assert up.poll() is None, "".join(lines)
        pid = int(re.findall(r"worker-1 \(pid (\d+)\) starting", "".join(lines))[0])
        epoch = workers(url)["worker-1"]["epoch"]
        os.killpg(pid, signal.SIGKILL)
        for i in range(20):  # while it is down and after: every request is answered
            assert complete(url, f"while worker-1 is down {i}")[0] == 200
        wait_until(lambda: any("worker-1 is back" in ln for ln in lines), 60)
        wait_until(lambda: workers(url).get("worker-1", {}).get("epoch", epoch) != epoch, 30)
        answered_by = {complete(url, f"after {i}")[1] for i in range(10)}
        assert "worker-1" in answered_by, answered_by
        assert up.poll() is None
        reports = [ln for ln in lines if ln.startswith("worker-1 exited")]
        assert len(reports) == 1 and "(killed by SIGKILL)" in reports[0], "".join(lines)
        assert "Restarting it in 1s (restart 1 of at most 5 within 120s)" in reports[0]
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    finally:
        print("".join(lines))  # shown when the test fails
        if up.poll() is None:
            for child in descendants(up.pid):
                os.kill(child, signal.SIGKILL)
            up.kill()
            up.wait()


def start_up(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`python -m router up ...` with its output collected line by line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [sys.executable, "-m", "router", "up", "--engine", "sim", "--start-timeout", "60", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(up.stdout.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    return up, lines


def end(up: subprocess.Popen[str], lines: list[str]) -> None:
    print("".join(lines))  # shown when the test fails
    if up.poll() is None:
        for child in descendants(up.pid):
            os.kill(child, signal.SIGKILL)
        up.kill()
        up.wait()


def test_up_restarts_a_killed_redis_and_requests_keep_succeeding() -> None:
    """Was: the Redis `up` started was killed and left <defunct>; `up` said nothing and
    /readiness kept saying all was well (issue 31)."""
    port = free_port()
    up, lines = start_up("--workers", "2", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: any("Press Ctrl-C" in ln for ln in lines) or up.poll() is not None, 90)
        assert up.poll() is None
        redis_pid = next(
            pid for pid in descendants(up.pid)
            if "server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        )  # fmt: skip
        os.kill(redis_pid, signal.SIGKILL)
        for i in range(20):  # the router routes on its last known fleet meanwhile
            assert complete(url, f"while Redis is down {i}")[0] == 200
        wait_until(lambda: any(ln.startswith("redis is back") for ln in lines), 60)
        reports = [ln for ln in lines if ln.startswith("redis exited")]
        assert len(reports) == 1 and "(killed by SIGKILL)" in reports[0]
        assert "Restarting it in 1s" in reports[0] and "re-registers" in reports[0]
        # The new, empty Redis fills again from the workers' heartbeats.
        wait_until(lambda: readiness(url).get("registry") == "reachable", 30)
        wait_until(lambda: set(workers(url)) == {"worker-0", "worker-1"}, 30)
        answered = {complete(url, f"after {i}")[0] for i in range(10)}
        assert answered == {200} and up.poll() is None
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    finally:
        end(up, lines)


def test_up_names_an_unreachable_redis_at_once() -> None:
    """Was: `up --redis-url` of a dead Redis waited the whole start timeout, then showed
    /health access lines cut mid-line and no word of Redis (issue 31)."""
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "router", "up", "--engine", "sim", "--port", "0",
         "--redis-url", f"redis://:hunter2@127.0.0.1:{free_port()}/0"],
        capture_output=True, cwd=ROOT, env=env, text=True, timeout=60,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1 and time.monotonic() - started < 30, output
    assert "error: Redis at redis://:***@127.0.0.1:" in output and "Connection refused" in output
    assert "hunter2" not in output


def test_a_failed_start_keeps_the_logs_and_shows_whole_last_lines() -> None:
    """Was: `up` deleted its log folder when it gave up unless --keep-logs (issue 31)."""
    up, lines = start_up("--workers", "1", "--port", "0", "--max-running-requests", "0")
    try:
        assert up.wait(90) == 1
        time.sleep(0.2)  # the reader drains the pipe
        output = "".join(lines)
        kept = re.findall(r"logs kept in (\S+) \(the fleet failed", output)
        assert kept and Path(kept[0], "worker-0.log").exists(), output
        shown = output.split("last lines of ", 1)[1].splitlines()[1:]
        assert shown and all(ln.startswith("  ") for ln in shown[:-1])
        assert any("max_running_requests" in ln for ln in shown), output
    finally:
        end(up, lines)
        for folder in re.findall(r"logs kept in (\S+)", "".join(lines)):
            subprocess.run(["rm", "-rf", folder], check=False)


def readiness(url: str) -> dict:
    return http_json(url + "/readiness")[1] or {}


def workers(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/workers", timeout=5) as r:
        return {w["worker_id"]: w for w in json.loads(r.read())["data"]}


def complete(url: str, prompt: str) -> tuple[int, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers["x-radix-worker"]
