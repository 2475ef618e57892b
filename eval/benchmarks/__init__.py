"""The developers' benchmarks, each `python -m eval.benchmarks.NAME`: speed and memory beside peers, the
kernels alone, real shapes with random weights, serving load, speculation, the functional suite for many
models, the README's tables and pictures. What `qlite eval` runs is the package above; nothing there
imports these."""
