"""Helpers of ``benchmarks/bench_peers_cpu.py``: the load tool, the peer servers it starts, the report.

The ``serve_*`` modules and ``intent_model`` run inside each peer's own venv (``scripts/peers.sh``) and import
nothing from miaohui; ``load``, ``procs`` and ``report`` run in the project's venv.
"""
