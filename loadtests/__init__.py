"""Load tests and benchmarks for radix-router: locust users, workloads, reports, simulation.

Run from a checkout: `python -m loadtests run|compare|simulate --help`.
"""
