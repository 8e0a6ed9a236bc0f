"""Time tfpipe.balance.partition on large random cost vectors (issue 3's bar: L=1000, K=64 under a second)."""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from tfpipe.balance import partition

flags.DEFINE_list("sizes", ["100:8", "1000:16", "1000:64"], "Cases as layers:cells.")
flags.DEFINE_integer("repeats", 3, "Timed runs per case; the median is printed.", lower_bound=1)


def main(argv: list[str]) -> None:
    del argv
    print(f"{'layers':>7} {'cells':>6} {'median s':>9} {'max cell / mean cell':>21}")
    for case in flags.FLAGS.sizes:
        layers, cells = (int(v) for v in case.split(":"))
        costs = np.random.default_rng(0).uniform(0.0, 1.0, layers)
        times = []
        for _ in range(flags.FLAGS.repeats):
            began = time.perf_counter()
            split = partition(costs, cells)
            times.append(time.perf_counter() - began)
        bounds = np.cumsum([0] + split)
        worst = max(costs[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:]))
        print(f"{layers:>7} {cells:>6} {np.median(times):>9.3f} {worst / (costs.sum() / cells):>21.3f}")


if __name__ == "__main__":
    app.run(main)
