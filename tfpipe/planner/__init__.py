"""The planner, above the model: ``tfpipe.plan`` (``choose``), the probes it trains the user's layers with on the
devices (``calibration``), and what it fits on their times (``probe_fits``). Below the model, ``tfpipe.planning``
holds the cost model it predicts with (profiles, the schedule simulated as data, the search).
"""

from tfpipe.planner.choose import (
    AUTO_MIN_SECONDS,
    AUTO_STEPS,
    NothingFits,
    Plan,
    optimizer_slots,
    plan,
    reused,
    verified,
)

__all__ = ["AUTO_MIN_SECONDS", "AUTO_STEPS", "NothingFits", "Plan", "optimizer_slots", "plan", "reused", "verified"]
