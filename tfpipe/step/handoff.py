"""What one unrolled step's tasks hand to each other, keyed by (cell, micro-batch): the step's bookkeeping."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfpipe.step.loss import LossFn


@dataclasses.dataclass
class Handoff:
    """Everything one step's tasks hand to each other, keyed by (cell, micro-batch)."""

    inputs: Sequence[Any]
    training: bool
    loss_fn: LossFn | None
    fractions: Sequence[tf.Tensor] | None
    loss_scale: Any
    weights: list[tuple[list[tf.Tensor], list[tf.Tensor]]]
    first: int = 0  # the global number of micro-batch 0 (a replica's first), for seeds
    acts: dict = dataclasses.field(default_factory=dict)  # cell outputs
    outputs: dict = dataclasses.field(default_factory=dict)  # the model's outputs per micro-batch
    flat_inputs: list = dataclasses.field(default_factory=list)  # routes: each micro-batch's input leaves
    received: dict = dataclasses.field(default_factory=dict)  # routes: (cell, micro-batch, device) -> {pos: copy}
    records: dict = dataclasses.field(default_factory=dict)  # checkpoints awaiting their backward (and W)
    new_state: dict = dataclasses.field(default_factory=dict)  # non-trainable values after each forward
    dys: dict = dataclasses.field(default_factory=dict)  # gradients arriving at each cell's outputs (routes: lists)
    losses: dict = dataclasses.field(default_factory=dict)  # weighted loss per micro-batch
    added: list = dataclasses.field(default_factory=list)  # add_loss and regularization terms
    grads: list = dataclasses.field(default_factory=list)  # summed weight gradients per cell
    batched: dict = dataclasses.field(default_factory=dict)  # cell -> its W cut to run once ("gpipe_batched_w")
    scales: list = dataclasses.field(default_factory=list)  # per cell: the loss scale, the gradient of added losses
    shares: dict = dataclasses.field(default_factory=dict)  # device -> fractions Grappler cannot fold (unfoldable)
    reg_weights: dict = dataclasses.field(default_factory=dict)  # device -> [1, 0] (micro-batch 0, others), likewise

    def __post_init__(self):
        self.grads = [None] * len(self.weights)

    def running(self, i: int) -> list[Any]:
        """Cell i's running sums of weight gradients (None before its first backward)."""
        return self.grads[i] if self.grads[i] is not None else [None] * len(self.weights[i][0])
