"""What the benchmark scripts share: timing the steps of a fit, and writing a table as CSV and Markdown."""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from typing import Any


def median_step_seconds(model: Any, x: Any, y: Any, batch_size: int, warmup: int) -> float:
    """Median seconds per training step over one ``fit`` of (x, y), the first ``warmup`` steps excluded.

    A step is timed from Keras' batch-begin to its batch-end callback.
    """
    import keras
    import numpy as np

    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        """Times each step from its begin to its end callback."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            """Start the clock."""
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            """Stop the clock."""
            times.append(time.perf_counter() - self.began)

    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    return float(np.median(times[warmup:]))


def write_table(
    out: str, rows: Sequence[dict[str, Any]], markdown: str | None, fields: Sequence[str] | None = None
) -> None:
    """Write ``rows`` to OUT.csv (columns ``fields``, default the first row's keys) and ``markdown`` to OUT.md."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields or rows[0]), restval="")
        writer.writeheader()
        writer.writerows(rows)
    if markdown is not None:
        with open(out + ".md", "w") as f:
            f.write(markdown + "\n")
