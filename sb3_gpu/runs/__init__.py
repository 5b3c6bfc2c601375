"""Runs: a run directory that owns every file name, the one training Session that train, tune and bench share,
callbacks, telemetry, checkpoints and evaluation. Nothing here chooses a hyperparameter."""
