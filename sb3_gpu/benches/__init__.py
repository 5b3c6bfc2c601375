"""Benchmarks behind ``python -m sb3_gpu.bench``: sb3_gpu and its SB3 baseline measured side by side in one process."""

# The callback sets `bench telemetry` compares, named here so that the CLI's parser needs no torch.
CALLBACK_SETS = ("telemetry", "guard", "session")
