"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3.

The public API is what ``__all__`` names: ``PipelineModel``, ``plan`` and its ``Plan``, ``deferred_weights``
(build a model too large for one device), and four public modules, ``tfpipe.balance``, ``tfpipe.cost``,
``tfpipe.schedule`` and ``tfpipe.cluster``, which keep these short paths (tfpipe._aliases). Everything else (the
subpackages ``partition``, ``planning``, ``step``, ``backward``, ``graph``, ``distributed`` and ``analysis``) is
internal and may change between releases.
"""

from tfpipe import _aliases
from tfpipe.distributed import cluster
from tfpipe.model import PipelineModel  # importing tfpipe registers it for keras.models.load_model
from tfpipe.partition.deferred import deferred_weights
from tfpipe.planner import Plan, plan
from tfpipe.planning import balance, cost
from tfpipe.step import schedule

__all__ = ["Plan", "PipelineModel", "balance", "cluster", "cost", "deferred_weights", "plan", "schedule"]
__version__ = "0.1.0"

_aliases.install()


def __getattr__(name: str):
    """An old module path read as an attribute (``tfpipe.pipeline``): the moved module, with a warning."""
    return _aliases.attribute(name)
