"""adapt's benchmarks: recurring measurements in ``tools/``, studies with their write-up in ``studies/``.

Run each as a module from the checkout root, e.g. ``python -m benchmarks.tools.embed_throughput --quick``;
what they share is in :mod:`benchmarks.common`. See ``benchmarks/README.md``.
"""
