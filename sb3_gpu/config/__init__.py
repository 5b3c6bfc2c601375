"""Configuration as data: the preset schema, YAML files, preset resolution with profiles and overrides, run configs and
search spaces. Nothing here touches a device or builds an env."""
