"""The package's version: one place, which the build reads and every layer may import."""

__version__ = "0.1.0"
