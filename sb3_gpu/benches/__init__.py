"""Benchmarks behind ``python -m sb3_gpu.bench``: sb3_gpu and its SB3 baseline measured side by side in one process."""
