"""The GPU check's markdown page, from its JSON report (loadtests/gpu/check.py).

Written for a partial report too: a section or step that failed shows its error,
one that was skipped or cut (the time budget or its cap) says why, one that never ran is
absent.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any


def to_markdown(report: dict[str, Any]) -> str:
    sections = report.get("sections", {})
    env = sections.get("env", {})
    device = env.get("device", {}) if isinstance(env.get("device"), dict) else {}
    versions = env.get("versions", {}) if isinstance(env.get("versions"), dict) else {}
    dry = " (DRY RUN: sample rows)" if "dry_run" in report else ""
    lines = [f"# GPU check: {device.get('name', 'device unknown')}{dry}", ""]
    if dry:
        lines += [f"**DRY RUN: {report['dry_run']}; every figure below is a sample.**", ""]
    vs = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "torch_cuda")
    lines += [f"{vs or 'versions unknown'}; `{report.get('command', '')}`; "
              f"{report.get('seconds', 0):.0f} s of a {report.get('budget_s', 0):.0f} s budget; "
              f"started {report.get('started', '?')}.", ""]  # fmt: skip
    bw = env.get("bandwidth")
    if isinstance(bw, dict) and "used_bytes_s" in bw:
        lines += [f"Memory bandwidth: measured copy {bw['measured_copy_bytes_s'] / 1e12:.2f} TB/s; "
                  f"the roofline uses {bw['used_bytes_s'] / 1e12:.2f} TB/s "
                  f"({'spec' if bw.get('spec_bytes_s') else 'measured'}).", ""]  # fmt: skip
    for name, result in sections.items():
        if name == "env":
            lines += _problems("env", result)
        elif name == "correctness":
            lines += _correctness(result)
        elif name == "ops":
            lines += _ops(result)
        elif name == "host_tier":
            from loadtests.gpu.host_tier import to_markdown as host_tier_markdown

            lines += host_tier_markdown(result) + _problems("host_tier", result)
        elif name.startswith("preset:"):
            lines += _preset(name.split(":", 1)[1], result)
        elif name == "pytest":
            lines += _pytest(result)
    return "\n".join(lines).rstrip() + "\n"


def _problems(title: str, result: dict[str, Any]) -> list[str]:
    """Skips, errors and a dead process of a section, as lines."""
    out = []
    if "skipped" in result:
        out.append(f"- {title}: skipped, {result['skipped']}")
    if "cut" in result:
        out.append(f"- {title}: CUT, {result['cut']}")
    if "process_error" in result:
        out.append(f"- {title}: {result['process_error']}")
    if "unfinished" in result:
        out.append(f"- {title}: {result['unfinished']} (killed?)")
    for key, value in result.items():
        if isinstance(value, dict) and "error" in value:
            out += [f"- {title} / {key} FAILED:", "", "```", value["error"].strip(), "```", ""]
        elif isinstance(value, dict) and "skipped" in value:
            out.append(f"- {title} / {key}: skipped, {value['skipped']}")
        elif isinstance(value, dict) and "cut" in value:
            out.append(f"- {title} / {key}: CUT, {value['cut']}")
    return out + ([""] if out else [])


def _correctness(r: dict[str, Any]) -> list[str]:
    lines = ["## Correctness on the device", ""]
    k = r.get("kernels")
    if isinstance(k, dict) and "cases" in k:
        worst = max((c["max_abs_diff"] for c in k["cases"]), default=0.0)
        dtypes = " and ".join(sorted({c["dtype"] for c in k["cases"]}))
        lines.append(f"- triton kernels vs SDPA, {len(k['cases'])} random mixed batches "
                     f"(decodes, prefix hits, chunked prefills; GQA 1/4/7; head dims 64/128; "
                     f"{dtypes}): {'equal' if k['passed'] else 'DIFFERENT'} (worst "
                     f"difference {worst:.2e}; in bf16 relative to the largest output)")  # fmt: skip
    s = r.get("syncs")
    if isinstance(s, dict) and "per_step" in s:
        each = ", ".join(f"{k} {v}" for k, v in s["per_step"].items())
        lines.append(f"- host synchronisations per engine step ({s['how']}): {each} "
                     f"({'one each' if s['passed'] else 'NOT one each'})")  # fmt: skip
        lines += [f"  - extra: {e}" for e in s.get("unexpected", [])[:8]]
    return [*lines, "", *_problems("correctness", r)]


def _ops(r: dict[str, Any]) -> list[str]:
    lines = ["## Kernels, fused ops, sampler, FP8 KV (issue 25)", ""]
    d = r.get("decode")
    if isinstance(d, dict) and "fp8_speedup" in d:
        lines.append(f"- decode attention, batch {d['batch']} x context {d['context']}, one "
                     f"layer (floor: its K/V bytes / measured copy bandwidth):")  # fmt: skip
        for name, v in d.items():
            if isinstance(v, dict):
                lines.append(f"  - {name} KV: {v['us_per_layer']} us, floor {v['floor_us']} us, "
                             f"ratio {v['ratio']}; vs SDPA {v['rel_diff_vs_sdpa']:.1e} "
                             f"({'equal' if v['passed'] else 'DIFFERENT'})")  # fmt: skip
        lines.append(f"  - fp8 KV vs {d.get('fp8_vs', '16-bit')}: {d['fp8_speedup']}x faster")
    from loadtests.gpu.kernels import baseline_markdown

    lines += baseline_markdown(r.get("baseline"))
    t = r.get("table")
    if isinstance(t, dict) and "fastest_row" in t:
        lines.append(
            f"- fastest blocks timed (RADIX_KERNEL_TABLE row): `{json.dumps(t['fastest_row'])}`"
        )
    f = r.get("fused")
    if isinstance(f, dict) and "tokens" in f:
        for name, v in f.items():
            if isinstance(v, dict):
                lines.append(f"- {name} ({f['tokens']} tokens, {f['dtype']}): eager {v['eager_us']} "
                             f"us, fused {v['fused_us']} us ({v['speedup']}x); difference "
                             f"{v['rel_diff']:.1e} ({'equal' if v['passed'] else 'DIFFERENT'})")  # fmt: skip
    sm = r.get("sampler")
    if isinstance(sm, dict) and "speedup" in sm:
        lines.append(f"- top-k/top-p, batch {sm['batch']} x vocab {sm['vocab']:,}: sort "
                     f"{sm['sort_ms']} ms, thresholds {sm['threshold_ms']} ms ({sm['speedup']}x); "
                     f"rows whose kept set differs: {sm['rows_whose_kept_set_differs']}; rows "
                     f"off an fp64 reference: sort {sm['rows_off_fp64_sort']}, thresholds "
                     f"{sm['rows_off_fp64_threshold']}")  # fmt: skip
    return [*lines, "", *_problems("ops", r)]


def _preset(preset: str, r: dict[str, Any]) -> list[str]:
    run = r.get("runner_sdpa", r.get("runner"))
    run = run if isinstance(run, dict) else {}
    lines = [f"## {preset} ({run.get('dtype', '?')}, attention {run.get('attention_backend', '?')})",
             ""]  # fmt: skip
    if "fallback" in r:
        lines.append(f"- FALLBACK: {r['fallback']}")
    if "weight_bytes" in run:
        lines.append(f"- weights {run['weight_bytes'] / 1e9:.2f} GB, KV "
                     f"{run['kv_bytes_per_token'] / 1024:.1f} KiB/token")  # fmt: skip
    g = r.get("greedy")
    if isinstance(g, dict) and "equal" in g:
        lines.append(f"- greedy tokens equal to transformers' (fp32, 3 prompts): {g['equal']}")
    if isinstance(r.get("kernels"), list):
        lines.append(
            f"- attention kernels in a mixed step: {', '.join(r['kernels']) or 'none seen'}"
        )
    if isinstance(r.get("prefill_tokens_s"), (int, float)):
        lines.append(f"- prefill: {r['prefill_tokens_s']:,.0f} tokens/s")
    t = r.get("ttft")
    if isinstance(t, dict) and "ratio" in t:
        lines.append(f"- TTFT with a {t['prefix_tokens']}-token prefix: uncached "
                     f"{t['uncached_ms']:.1f} ms, cached {t['cached_ms']:.1f} ms (ratio "
                     f"{t['ratio']:.3f}, {t['cached_tokens']} tokens hit)")  # fmt: skip
    e = r.get("eager_point")
    if isinstance(e, dict) and "ms" in e:
        lines.append(f"- eager (no CUDA graph) at batch {e['batch']}, context {e['context']}: "
                     f"{e['ms']} ms/step; CUDA graph replays {r.get('graph_replays', 0)}")  # fmt: skip
    c = r.get("startup_capture")
    if isinstance(c, dict) and "seconds" in c:
        late = r.get("no_capture_in_traffic", {})
        lines.append(f"- decode graphs captured at start-up: {c.get('captures', 0)} buckets in "
                     f"{c['seconds']} s; captured during traffic: "
                     f"{late.get('late_captures', '?') if isinstance(late, dict) else '?'}")  # fmt: skip
    o = r.get("overlap_decode")
    if isinstance(o, dict) and "overlap_ms" in o:
        lines.append(f"- engine decode at batch {o['batch']}, context {o['context']}: overlap "
                     f"{o['overlap_ms']} ms/step vs in order {o['in_order_ms']} ms/step "
                     f"({o['speedup']}x); greedy equal: {o['greedy_equal']}")  # fmt: skip
    m = r.get("piecewise_mixed")
    if isinstance(m, dict) and "piecewise_ms" in m:
        lines.append(f"- mixed step ({m['decodes']} decodes at context {m['context']} + a "
                     f"{m['chunk']}-token chunk, {m['graphs']} graphs): piecewise "
                     f"{m['piecewise_ms']} ms vs eager {m['eager_ms']} ms ({m['speedup']}x); "
                     f"bucket captured in {m['capture_s']} s, late captures "
                     f"{m['late_captures']}, logits max diff {m['max_abs_diff']:.3g}")  # fmt: skip
    if "peak_memory_gib" in r:
        lines.append(f"- peak device memory {r['peak_memory_gib']} GiB")
    cells = r.get("decode")
    if isinstance(cells, list) and cells:
        lines += [
            "",
            "Contiguous: each sequence's slots one run (a fresh pool); fragmented: the batch's "
            "slots shuffled token by token (a pool in service, at its worst).",
            "",
            "| batch | context | ms/step | roofline ms | ratio | floor at measured copy bw, ms "
            "| ratio | fragmented ms/step | fragmented ratio | fragmented / contiguous |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for d in sorted(cells, key=lambda d: (d["context"], d["batch"])):
            if "ms" in d:
                cut = "CUT (time budget)" if "cut" in d else ""
                lines.append(f"| {d['batch']} | {d['context']} | {d['ms']} | {d['roofline_ms']} "
                             f"| {d['roofline_ratio']} | {d.get('measured_floor_ms', '')} "
                             f"| {d.get('measured_ratio', '')} | {d.get('fragmented_ms', cut)} "
                             f"| {d.get('fragmented_ratio', '')} "
                             f"| {d.get('fragmented_over_contiguous', '')} |")  # fmt: skip
            else:
                why = "CUT (time budget)" if "cut" in d else "FAILED (see the JSON)"
                lines.append(f"| {d['batch']} | {d['context']} | {why} | | | | | | | |")
    return [*lines, "", *_problems(preset, r)]


def _pytest(r: dict[str, Any]) -> list[str]:
    if "skipped" in r:
        return [f"pytest -m gpu: skipped, {r['skipped']}", ""]
    if "cut" in r and "tail" not in r:
        return [f"pytest -m gpu: CUT, {r['cut']}", ""]
    lines = [f"pytest -m gpu: {'passed' if r.get('passed') else 'FAILED'} (`{r.get('command')}`)"]
    if not r.get("passed"):
        lines += ["", "```", str(r.get("tail", "")).strip()[-2500:], "```"]
    return [*lines, ""]


def write(out: Path, report: dict[str, Any]) -> None:
    """gpu-check.json and gpu-check.md, replaced atomically (a kill mid-write keeps the
    previous version)."""
    try:
        md = to_markdown(report)
    except Exception:  # a report bug must not cost the JSON
        md = "# GPU check\n\nthe markdown failed; gpu-check.json has the results\n\n```\n"
        md += traceback.format_exc() + "```\n"
    for name, text in (("gpu-check.json", json.dumps(report, indent=2, default=str)),
                       ("gpu-check.md", md)):  # fmt: skip
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
