"""Reading a step's graph back: which task and phase each op belongs to (scripts/timeline.py).

Internal: the public API is what tfpipe.__all__ names.
"""
