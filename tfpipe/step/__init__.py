"""One training step: the schedule, micro-batches, the loss, the executors and their gradient sums.

Internal: the public API is what tfpipe.__all__ names.
"""
