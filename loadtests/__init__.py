"""Load tests and benchmarks for radix-router, in five sections: load, simulate, router,
engine, gpu.

Run from a checkout: `python -m loadtests --help` lists every command by section.
"""
