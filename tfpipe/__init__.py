"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from tfpipe import balance, cost, schedule
from tfpipe.model import PipelineModel

__all__ = ["PipelineModel", "balance", "cost", "schedule"]
__version__ = "0.1.0"
