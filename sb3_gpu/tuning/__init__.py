"""Hyperparameter search with optuna: storages shared by many workers, trials trained through the same Session as
``train``, and the best trial exported as a preset."""
