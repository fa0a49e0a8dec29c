"""fm-bench: side-by-side cost of FutureMap implementations (fm_jax, fm_torch, a naive JAX map).

Entry point: `fm-bench` (fm_bench.cli:main). Measurements are interleaved so that machine noise
hits every implementation alike; see fm_bench/timing.py.
"""
