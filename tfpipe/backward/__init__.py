"""One cell's backward: re-materialization, zero bubble's B/W split, one batched W, replayed traces.

Internal: the public API is what tfpipe.__all__ names.
"""
