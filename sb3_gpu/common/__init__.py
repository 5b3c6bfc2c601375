"""What every layer may use: errors, hardware facts, atomic file writes, value checks and CLI helpers. It imports
nothing of the project above it."""
