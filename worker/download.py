"""`radix-worker download MODEL --revision R --dir D`: fill a model folder from the Hub.

The chart runs this as the worker pod's init container, so weights land in the cache
volume (a PVC that outlives pods, or an emptyDir) before the worker starts. It is
huggingface_hub's `snapshot_download` (resumable, verified against the Hub's ETags,
mirrors through `HF_ENDPOINT`), with three choices of ours:

- Only what a worker reads: config, tokenizer and chat-template files and
  `*.safetensors` (no `.bin`/`.pt` duplicates, no ONNX/GGUF exports, often as large again).
- A pinned `--revision` (commit, tag or branch) is the rollout's contract; the commit it
  resolved to is written to `D/.radix-revision`. Files already in `D` at that commit
  are checked (one HEAD each) but not fetched again, so a restarted pod on a PVC
  starts at once.
- The token comes from the environment (`HF_TOKEN`, from a Secret in the chart), never
  a flag: flags show in `ps` and in the pod spec.

A local model path is not downloaded: `MODEL` that is an existing folder is copied
nowhere and reported as is (the chart's `model` may be either).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ALLOW_PATTERNS = (
    "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py",
)  # fmt: skip
REVISION_FILE = ".radix-revision"


class DownloadError(RuntimeError):
    """The model could not be fetched; the message says why (for the pod's log)."""


@dataclass(frozen=True)
class Downloaded:
    path: Path
    commit: str | None  # None for a local folder
    fetched: bool  # False: already present


def download(model: str, target: str | Path, revision: str | None = None) -> Downloaded:
    if Path(model).is_dir():
        return Downloaded(Path(model), None, False)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    target = Path(target)
    marker = target / REVISION_FILE
    token = os.environ.get("HF_TOKEN") or None
    try:
        path = snapshot_download(
            repo_id=model, revision=revision, local_dir=target, token=token,
            allow_patterns=list(ALLOW_PATTERNS),
        )  # fmt: skip
    except LocalEntryNotFoundError as exc:
        raise DownloadError(f"{model}@{revision or 'main'} is not reachable: {exc}") from None
    except HfHubHTTPError as exc:
        raise DownloadError(f"{model}@{revision or 'main'}: {exc}") from None
    commit = _commit_of(target)
    previous = marker.read_text().strip() if marker.exists() else None
    if commit is not None:
        marker.write_text(commit + "\n")
    if not (Path(path) / "config.json").exists():
        raise DownloadError(f"{model}@{revision or 'main'} has no config.json: not a model folder")
    return Downloaded(Path(path), commit, previous != commit)


def _commit_of(target: Path) -> str | None:
    """The commit huggingface_hub recorded for the files it placed in `target`."""
    meta = target / ".cache" / "huggingface" / "download"
    for item in sorted(meta.glob("*.metadata")) if meta.is_dir() else []:
        first = item.read_text().splitlines()[:1]
        if first and first[0].strip():
            return first[0].strip()
    return None
