"""One cell's backward: re-materialization, zero bubble's B/W split, one batched W, replayed traces."""
