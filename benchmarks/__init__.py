"""Benchmarks of lucid_replay against the gather floor, TorchRL 0.14.1 and a naive baseline.

Run ``python -m benchmarks.run`` (or ``make bench``); see ``docs/benchmarks.md``.
"""
