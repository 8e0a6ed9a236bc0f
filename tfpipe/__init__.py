"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3.

The public API is what ``__all__`` names: ``PipelineModel`` and four public modules,
``tfpipe.balance``, ``tfpipe.cost``, ``tfpipe.schedule`` and ``tfpipe.cluster``. Everything
else (the subpackages ``partition``, ``planning``, ``step``, ``backward``, ``graph``,
``distributed`` and ``analysis``) is internal and may change between releases.
"""

import sys

from tfpipe import _deprecated
from tfpipe.distributed import cluster
from tfpipe.model import PipelineModel
from tfpipe.planning import balance, cost
from tfpipe.step import schedule

__all__ = ["PipelineModel", "balance", "cluster", "cost", "schedule"]
__version__ = "0.1.0"

# The public modules keep their short paths: `import tfpipe.balance`, `from tfpipe.cluster import LocalCluster`.
for _module in (balance, cluster, cost, schedule):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
_deprecated.install()


def __getattr__(name: str):
    """An old module path read as an attribute (``tfpipe.pipeline``): the moved module, with a warning."""
    return _deprecated.attribute(name)
