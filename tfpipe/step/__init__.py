"""One training step: the schedule, micro-batches, the loss, per-micro-batch state and the executors."""
