"""`radix-worker`: flags, config errors, the ready line, SIGTERM drain, make-tiny-model."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.procs import wait_until
from tests.worker.conftest import WorkerProcess
from worker.cli import main
from worker.engine.runtime.kv_pool import cpu_available_bytes


def post(url: str, body: dict[str, object], timeout: float = 30) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--port", "99999"], {}, "port"),
        (["--engine", "tpu"], {}, "engine"),
        ([], {"RADIX_WORKER_PAGE_SIZE": "0"}, "page_size"),
        (["--engine", "radix"], {}, "model"),
        (["--attention-backend", "flash"], {}, "attention_backend"),
        (["--host-cache-tokens", "-5"], {}, "host_cache_tokens"),
        ([], {"RADIX_WORKER_HOST_CACHE_TOKENS": "1.5"}, "host_cache_tokens"),
        ([], {"RADIX_WORKER_HOST_CACHE_TOKENS": "'8'"}, "host_cache_tokens"),
        (["--host-write-policy", "sometimes"], {}, "host_write_policy"),
        (["--kv-cache-dtype", "fp8"], {}, "kv_cache_dtype"),
        (["--piecewise-cuda-graph-max-tokens", "-1"], {}, "piecewise_cuda_graph_max_tokens"),
    ],
)
def test_bad_config_exits_2_naming_the_key(
    argv: list[str], env: dict[str, str], named: str,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["serve", "--engine", "sim", *argv]) == 2
    assert named in capsys.readouterr().err


def test_a_fractional_host_tier_flag_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's own refusal
        main(["serve", "--engine", "sim", "--host-cache-tokens", "1.5"])
    assert e.value.code == 2
    assert "--host-cache-tokens: invalid int value: '1.5'" in capsys.readouterr().err


def test_host_tier_beyond_host_memory_is_refused_at_start_with_the_number(
    tiny_model_dir: Path, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    huge = cpu_available_bytes() + 1  # tokens: at least a byte each, so it cannot fit
    worker = spawn_worker("--engine", "radix", "--model", str(tiny_model_dir), "--device", "cpu",
                          "--cache-tokens", "256", "--host-cache-tokens", str(huge))  # fmt: skip
    assert worker.proc.wait(120) != 0
    assert f"host_cache_tokens {huge} needs" in worker.log() and "available" in worker.log()


def test_the_sim_engine_refuses_a_host_tier_beyond_host_memory_the_same_way(
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    """Was: a numpy traceback asking for 7.11 PiB (issue 31)."""
    huge = 10**15
    worker = spawn_worker("--engine", "sim", "--host-cache-tokens", str(huge))
    assert worker.proc.wait(60) == 1
    log = worker.log()
    assert f"engine cannot start: host_cache_tokens {huge} needs" in log and "available" in log
    assert "Traceback" not in log


def test_unknown_key_in_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text("engine: sim\ncache_tokenz: 5\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cache_tokenz" in err and "unknown key" in err


def test_ready_line_and_sigterm_drain(spawn_worker: Callable[..., WorkerProcess]) -> None:
    worker = spawn_worker("--engine", "sim", "--worker-id", "cli-drain",
                          "--sim-decode-ms-per-token", "5", "--drain-timeout", "20")  # fmt: skip
    worker.wait_ready()
    assert f"serving sim on {worker.url} (engine=sim)" in worker.log()
    result: dict[str, object] = {}

    def long_request() -> None:
        result["answer"] = post(
            worker.url + "/v1/completions", {"prompt": "slow", "max_tokens": 200}
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(
        lambda: b"running_requests 1.0" in urllib.request.urlopen(worker.url + "/metrics").read(),
        10,
    )
    worker.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not worker.healthy(), 10)  # /health 503 while draining
    status, body = post(worker.url + "/v1/completions", {"prompt": "late", "max_tokens": 1})
    assert status == 503 and body["error"]["code"] == "draining"  # type: ignore[index]
    thread.join(30)
    status, body = result["answer"]  # type: ignore[misc]
    assert status == 200 and body["usage"]["completion_tokens"] == 200  # in flight: finished
    assert worker.proc.wait(30) == 0, worker.log()


def test_make_tiny_model_then_sim_serves_its_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spawn_worker: Callable[..., WorkerProcess]
) -> None:
    out = tmp_path / "tiny"
    assert main(["make-tiny-model", str(out), "--layers", "1", "--vocab-size", "512"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and (out / "tokenizer.json").is_file()
    worker = spawn_worker("--engine", "sim", "--model", str(out)).wait_ready()
    status, body = post(worker.url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})  # fmt: skip
    assert status == 200, body
    assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 3  # type: ignore[index]


@pytest.mark.slow
def test_serve_with_the_triton_backend_on_cpu_answers_as_sdpa(
    tiny_model_dir: Path, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    """`--device cpu --attention-backend triton` (triton's interpreter: TRITON_INTERPRET=1
    is set for the tests on a machine without a GPU) gives sdpa's greedy completion."""
    pytest.importorskip("triton")
    texts = []
    for backend in ("sdpa", "triton"):
        worker = spawn_worker("--engine", "radix", "--model", str(tiny_model_dir),
                              "--device", "cpu", "--attention-backend", backend,
                              "--cache-tokens", "2048", "--served-model-name", "tiny").wait_ready()  # fmt: skip
        status, body = post(worker.url + "/v1/completions", {
            "model": "tiny", "prompt": "The cat sees a red ball", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert status == 200, body
        texts.append(body["choices"][0]["text"])  # type: ignore[index]
    assert texts[0] == texts[1] and texts[0]


def test_attach_refuses_a_worker_id_routers_would_drop(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["attach", "--upstream", "http://127.0.0.1:8000", "--engine", "vllm"]
    code = main([*args, "--redis-url", "redis://127.0.0.1:1", "--worker-id", "pod/0 x"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("radix-worker attach: worker id") and "Traceback" not in err
