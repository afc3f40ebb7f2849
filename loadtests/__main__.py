"""`python -m loadtests {run,report,compare,simulate,scheduler}`: the load-test command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _report(args: argparse.Namespace) -> int:
    from loadtests.metrics import HitCounter, read_records
    from loadtests.report import write_report

    records = read_records(args.records)
    summary = write_report(records, args.out or Path(args.records).parent)
    print(summary.table())
    print(HitCounter.from_records(records).table())
    return 0


def main(argv: list[str] | None = None) -> int:
    from loadtests import bench_scheduler, compare, runner, simulate

    ap = argparse.ArgumentParser(prog="python -m loadtests", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="locust headless against a URL, with a report")
    runner.add_arguments(p)
    p.set_defaults(func=runner.main)
    p = sub.add_parser("report", help="summary and plots from a records.jsonl")
    p.add_argument("records", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=_report)
    p = sub.add_parser("compare", help="routing policies side by side on a local sim fleet")
    compare.add_arguments(p)
    p.set_defaults(func=compare.main)
    p = sub.add_parser("simulate", help="fleet simulation in virtual time")
    simulate.add_arguments(p)
    p.set_defaults(func=simulate.main)
    p = sub.add_parser("scheduler", help="one worker: fcfs vs lpm, in-flight sharing on vs off")
    bench_scheduler.add_arguments(p)
    p.set_defaults(func=bench_scheduler.main)
    args = ap.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
