"""Reading a step's graph back: which task and phase each op belongs to (scripts/timeline.py)."""
