"""Load: real processes under real traffic (run, report, compare, sweep, replicas, faults)."""
