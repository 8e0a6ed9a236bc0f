"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3.

The public API is what ``__all__`` names: ``PipelineModel``, ``plan`` and its ``Plan`` (``NothingFits`` where no
configuration fits the budget), ``deferred_weights`` (build a model too large for one device), and four public
modules, ``tfpipe.balance``, ``tfpipe.cost``, ``tfpipe.schedule`` and ``tfpipe.cluster``. Everything else (the
subpackages ``partition``, ``planning``, ``step``, ``backward``, ``graph``, ``distributed`` and ``analysis``, and the
other modules here) is internal and may change between releases.
"""

from tfpipe import balance, cluster, cost, schedule
from tfpipe.model import PipelineModel  # importing tfpipe registers it for keras.models.load_model
from tfpipe.partition.deferred import deferred_weights
from tfpipe.planner import NothingFits, Plan, plan

__all__ = ["NothingFits", "Plan", "PipelineModel", "balance", "cluster", "cost", "deferred_weights", "plan", "schedule"]
__version__ = "0.1.0"
