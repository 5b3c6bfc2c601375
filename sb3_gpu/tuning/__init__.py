"""Hyperparameter search with optuna: storages shared by many workers, trials trained through the same Session as
``train``, and the best trial exported as a preset."""

# The samplers and pruners `tune` offers, named here so that the CLI's parser needs no optuna.
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "none")
