"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from tfpipe import balance, cluster, cost, schedule
from tfpipe.model import PipelineModel

__all__ = ["PipelineModel", "balance", "cluster", "cost", "schedule"]
__version__ = "0.1.0"
