"""The `triage` command line."""
