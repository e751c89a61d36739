"""Configuration as pure data: the settings object, its bounds and loading, preflight checks."""
