"""tfpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from tfpipe import balance, schedule
from tfpipe.model import PipelineModel

__all__ = ["PipelineModel", "balance", "schedule"]
__version__ = "0.1.0"
