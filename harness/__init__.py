"""The harness around the library: demo, chaos, workload simulator, tune and benchmarks.

Nothing in `orchestrator/` (the product) imports from here; these tools import the product
and attack or measure it.
"""
