"""The triton kernels compile for Hopper (sm_90, the GPU machine's H200) here, with no
GPU: `triton.compile` with an explicit target runs the whole pipeline (TTIR, TTGIR,
LLVM IR, PTX, then the wheel's own ptxas to a cubin), so this catches what the
interpreter cannot: constexpr misuse, `tl.dot` shape and dtype limits, block shapes,
shared memory beyond what a Hopper block may have (227 KiB), register spills
(ptxas -v, the wheel's own ptxas, as triton runs it on the GPU machine), and that the
bf16 attention loops are software-pipelined (`cp.async` in the PTX: the next tiles'
K/V loads in flight while one is reduced).

The launches compiled are the real ones: the backend attends a batch on CPU tensors
while the kernels are swapped for recorders, so the signatures (dtypes, constexprs,
block sizes) are exactly what the GPU would JIT for these shapes: the presets of the
GPU check (Qwen2.5-0.5B 14/2 heads, Llama-3.2-1B 32/8, head dim 64), Qwen3's head
dim 128, the tiny test model (head dim 32), GQA 1 and 7; bf16 (serving) and fp32
(the greedy-equality runs), decode with 1 and 16 splits, extend with both row blocks.

Run as `python -m tests.worker.engine.test_triton_compile` it prints the resource
table; the test runs that in a process of its own, without TRITON_INTERPRET (under
the interpreter @triton.jit makes interpreter functions, which do not compile).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

HOPPER_SMEM = 227 * 1024  # the most dynamic shared memory one block may have on sm_90
KERNELS = ("_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel")
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.float8_e4m3fn: "fp8e4nv",
         torch.int32: "i32", torch.int64: "i64"}  # fmt: skip
# (heads, kv_heads, head_dim): the presets, Qwen3's head dim, the tiny model, GQA 1.
SHAPES = [(14, 2, 64), (32, 8, 64), (16, 8, 128), (2, 1, 32), (4, 4, 128)]
DTYPES = (torch.bfloat16, torch.float32)
# bf16 activations over an fp8 KV pool (--kv-cache-dtype fp8_e4m3): the presets' shape
# and head dim 128.
FP8_KV_SHAPES = [(32, 8, 64), (16, 8, 128)]
FP8_KV = "torch.bfloat16+fp8-kv"
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_kernels_compile_for_hopper() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-hopper-")
    done = subprocess.run([sys.executable, "-m", "tests.worker.engine.test_triton_compile"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert {(r["dtype"], tuple(r["shape"])) for r in rows} == {
        (str(d), s) for d in DTYPES for s in SHAPES
    } | {(FP8_KV, s) for s in FP8_KV_SHAPES}
    assert {r["kernel"] for r in rows} == set(KERNELS)
    for r in rows:
        assert r["shared"] <= HOPPER_SMEM, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r  # no register spills
        assert 0 < r["regs"] <= 255, r
        if r["dtype"] in ("torch.bfloat16", FP8_KV) and r["kernel"] != "_decode_merge_kernel":
            assert r["stages"] > 1 and r["cp_async"], r  # K/V loads software-pipelined


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` records."""

    def __init__(self, fn: Any, seen: dict) -> None:
        self.fn = fn
        self.seen = seen

    def __getitem__(self, grid: tuple) -> Any:
        def launch(*args: Any, **constexprs: Any) -> None:
            options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
            names = list(inspect.signature(self.fn.fn).parameters)
            values = list(args) + [None] * len(constexprs)
            sig = {n: "constexpr" if n in constexprs else _type(a)
                   for n, a in zip(names, values, strict=True)}  # fmt: skip
            key = (self.fn.fn.__name__, tuple(sorted(sig.items())),
                   tuple(sorted(constexprs.items())), tuple(sorted(options.items())))  # fmt: skip
            consts = {(names.index(k),): v for k, v in constexprs.items()}
            # The JIT's alignment specialisation: a pointer or an int divisible by 16
            # is marked so (vectorised, cp.async-able loads depend on it).
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args) if _aligned(a)}
            self.seen[key] = (self.fn, sig, consts, options, attrs)

        return launch


def _aligned(arg: Any) -> bool:
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr() % 16 == 0
    return isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0


def _type(arg: Any) -> str:
    if isinstance(arg, torch.Tensor):
        return "*" + TYPES[arg.dtype]
    if isinstance(arg, bool) or not isinstance(arg, (int, float)):
        raise TypeError(f"unexpected kernel argument {arg!r}")
    return "fp32" if isinstance(arg, float) else ("i32" if abs(arg) < 2**31 else "i64")


class _Item:
    def __init__(self, ids: list[int], start: int, slots: np.ndarray) -> None:
        self.input_ids, self.start_pos, self.slots = ids, start, slots.astype(np.int64)
        self.dirty_from, self.sample = 0, True


def launches(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, fp8_kv: bool = False
) -> dict:
    """Every distinct kernel launch of a decode batch (1 and 16 splits) and of
    extends with short and long new-token runs, as the GPU would get them."""
    from worker.engine.runtime.attention import triton_backend, triton_kernels
    from worker.engine.runtime.attention.metadata import ReqToTokenTable, Staging, build_step

    seen: dict = {}
    originals = {name: getattr(triton_kernels, name) for name in KERNELS}
    for name, fn in originals.items():
        setattr(triton_kernels, name, Recorder(fn, seen))
    cpu = torch.device("cpu")
    k_buf = torch.zeros(600, kv_heads, head_dim, dtype=torch.float8_e4m3fn if fp8_kv else dtype)
    backend = triton_backend.TritonBackend([k_buf], [k_buf], num_heads=heads, head_dim=head_dim,
                                           device=cpu, kv_scales=[(0.5, 0.5)] if fp8_kv else None)  # fmt: skip
    rng = np.random.default_rng(0)
    batches = ([(40, 1), (90, 1), (7, 1)], [(0, 9), (30, 12), (5, 1)], [(0, 70), (50, 40)])
    try:
        for items in batches:  # (start_pos, new tokens) per item
            table = ReqToTokenTable(4, 256, cpu)
            table.dtype, table.table = torch.int32, table.table.to(torch.int32)  # as on CUDA
            free, used, batch = rng.permutation(599), 0, []
            for start, n in items:
                batch.append(_Item(list(range(n)), start, free[used : used + start + n]))
                used += start + n
            meta = build_step(batch, list(range(len(batch))), table, Staging(cpu)).meta
            t = sum(n for _, n in items)
            q = torch.zeros(t, heads + 2 * kv_heads, head_dim, dtype=dtype)[:, :heads]  # fused
            for splits in (1, 16):
                backend.num_splits = splits
                backend.attend(0, q, q[:, :kv_heads], q[:, :kv_heads], meta)
    finally:
        for name, fn in originals.items():
            setattr(triton_kernels, name, fn)
    return seen


def resources(ptx: str, arch: str, tool: Path) -> dict[str, int]:
    """Registers, stack frame and spill bytes per ptxas -v (the wheel's ptxas: what
    triton runs on the GPU machine too)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([str(tool), "-v", f"--gpu-name={arch}", str(src), "-o",
                               str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                              check=True)  # fmt: skip
    info = done.stdout + done.stderr
    found = {
        "regs": r"Used (\d+) registers",
        "stack": r"(\d+) bytes stack frame",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
    }
    return {k: int(m.group(1)) if (m := re.search(rx, info)) else -1 for k, rx in found.items()}


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    hopper = GPUTarget("cuda", 90, 32)
    from triton.backends.nvidia.compiler import get_ptxas

    tool = Path(get_ptxas(90).path)  # the one triton itself runs for sm_90
    rows = []
    runs = [(d, s, False) for d in DTYPES for s in SHAPES]
    runs += [(torch.bfloat16, s, True) for s in FP8_KV_SHAPES]
    for dtype, shape, fp8_kv in runs:
        for fn, sig, constexprs, options, attrs in launches(dtype, *shape, fp8_kv).values():
            kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=hopper,
                                    options=options)  # fmt: skip
            label = FP8_KV if fp8_kv else str(dtype)
            row = {"kernel": fn.fn.__name__, "dtype": label, "shape": shape,
                   "constexprs": {fn.arg_names[k[0]]: v for k, v in constexprs.items()},
                   "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps,
                   "stages": options.get("num_stages", 3),
                   "cp_async": "cp.async" in kernel.asm["ptx"]}  # fmt: skip
            arch = "sm_90a" if "sm_90a" in kernel.asm["ptx"] else "sm_90"
            row |= resources(kernel.asm["ptx"], arch, tool)
            print(f"{row['kernel']:22} {row['dtype']:15} {shape} shared {row['shared']:6} "
                  f"warps {row['warps']} stages {row['stages']} cp.async {row['cp_async']:d} "
                  f"regs {row['regs']:3} spills {row['spill_stores']} "
                  f"{row['constexprs']}",
                  file=sys.stderr)  # fmt: skip
            rows.append(row)
    print(f"triton {triton.__version__}: {len(rows)} kernels compiled for sm_90", file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
