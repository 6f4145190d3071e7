"""Facts of the machine a command runs on: which devices a `--device` may name (devices.py), and its limits and
settings (perf.py: the matmul peak and memory bandwidth the benchmarks measure, the allocator setting)."""
