"""The user's tools (train, plan, timeline, sweep, worker): run from the repository as ``python scripts/NAME.py``."""
