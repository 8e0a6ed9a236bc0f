"""AmoebaNet-D (L, D) for ImageNet-style inputs as a list of layers: stem, one cell per layer, classifier head."""

from __future__ import annotations

from typing import Any

import keras

# The AmoebaNet-D genotype, as in torchgpipe's benchmark model (which reproduces the parameter counts of
# GPipe's Table 1). A cell starts from two hidden states, 0 = the current state and 1 = the previous
# one, each first projected to the cell's filters. Every two consecutive (input state, operation) pairs
# are summed into a new hidden state (numbered from 2 on); the cell outputs the concatenation of the
# hidden states listed in *_CONCAT. In a reduction cell, operations reading state 0 or 1 have stride 2.
NORMAL_OPERATIONS = (
    (1, "conv_1x1"),
    (1, "max_pool_3x3"),
    (1, "none"),
    (0, "conv_1x7_7x1"),
    (0, "conv_1x1"),
    (0, "conv_1x7_7x1"),
    (2, "max_pool_3x3"),
    (2, "none"),
    (1, "avg_pool_3x3"),
    (5, "conv_1x1"),
)
NORMAL_CONCAT = (0, 3, 4, 6)  # as TensorFlow's reference code (the paper says 4, 5, 6); GPipe's sizes need it
REDUCTION_OPERATIONS = (
    (0, "max_pool_2x2"),
    (0, "max_pool_3x3"),
    (2, "none"),
    (1, "conv_3x3"),
    (2, "conv_1x7_7x1"),
    (2, "max_pool_3x3"),
    (3, "none"),
    (1, "max_pool_2x2"),
    (2, "avg_pool_3x3"),
    (3, "conv_1x1"),
)
REDUCTION_CONCAT = (4, 5, 6)


def _batch_norm() -> keras.layers.BatchNormalization:
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)  # PyTorch's defaults, as in torchgpipe


class PointwiseConv(keras.layers.Layer):
    """A 1x1 convolution without bias; a stride keeps every stride-th pixel first, then convolves.

    The same numbers as a strided 1x1 ``Conv2D``, without its kernel: TensorFlow 2.21's oneDNN filter gradient of a
    strided 1x1 convolution crashes the process on one image with under 16 input channels (a micro-batch of one row,
    which the planner measures; docs/guide/limitations.md).
    """

    def __init__(self, filters: int, strides: int | tuple[int, int] = 1, **kwargs: Any):
        super().__init__(**kwargs)
        self.filters = filters
        self.strides = tuple(strides) if isinstance(strides, (list, tuple)) else (strides, strides)
        self.conv = keras.layers.Conv2D(filters, 1, use_bias=False)

    def build(self, input_shape):
        self.conv.build(input_shape)

    def compute_output_shape(self, input_shape):
        n, h, w, _ = input_shape
        sh, sw = self.strides
        return (n, None if h is None else -(-h // sh), None if w is None else -(-w // sw), self.filters)

    def call(self, x):
        sh, sw = self.strides
        return self.conv(x[:, ::sh, ::sw, :] if (sh, sw) != (1, 1) else x)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters, "strides": self.strides}


class ReluConvBN(keras.layers.Layer):
    """ReLU, convolution without bias, BatchNorm."""

    def __init__(
        self, filters: int, kernel_size: int | tuple[int, int] = 1, strides: int | tuple[int, int] = 1, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.filters = filters
        self.kernel_size = tuple(kernel_size) if isinstance(kernel_size, (list, tuple)) else kernel_size
        self.strides = tuple(strides) if isinstance(strides, (list, tuple)) else strides
        if self.kernel_size in (1, (1, 1)):
            self.conv = PointwiseConv(filters, strides)
        else:
            self.conv = keras.layers.Conv2D(filters, kernel_size, strides=strides, padding="same", use_bias=False)
        self.bn = _batch_norm()

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(self.conv.compute_output_shape(input_shape))

    def compute_output_shape(self, input_shape):
        return self.conv.compute_output_shape(input_shape)

    def call(self, x, training=False):
        return self.bn(self.conv(keras.ops.relu(x)), training=training)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
        }


class FactorizedReduce(keras.layers.Layer):
    """Halve height and width: ReLU, two 1x1/2 convolutions on grids offset by one pixel, concatenated, BatchNorm."""

    def __init__(self, filters: int, **kwargs: Any):
        if filters % 2:
            raise ValueError(f"FactorizedReduce(filters={filters}) needs an even filter count (two halves).")
        super().__init__(**kwargs)
        self.filters = filters
        self.conv1 = PointwiseConv(filters // 2, 2)
        self.pad = keras.layers.ZeroPadding2D(((0, 1), (0, 1)))
        self.conv2 = PointwiseConv(filters // 2, 2)
        self.bn = _batch_norm()

    def build(self, input_shape):
        self.conv1.build(input_shape)
        self.conv2.build(input_shape)
        self.bn.build(self.compute_output_shape(input_shape))

    def compute_output_shape(self, input_shape):
        return self.conv1.compute_output_shape(input_shape)[:-1] + (self.filters,)

    def call(self, x, training=False):
        x = keras.ops.relu(x)
        shifted = self.pad(x[:, 1:, 1:, :])
        return self.bn(keras.ops.concatenate([self.conv1(x), self.conv2(shifted)], axis=-1), training=training)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters}


class AmoebaOperation(keras.layers.Layer):
    """One genotype operation (e.g. "conv_1x7_7x1") on ``filters`` channels with the given stride."""

    def __init__(self, operation: str, filters: int, stride: int = 1, **kwargs: Any):
        super().__init__(**kwargs)
        self.operation, self.filters, self.stride = operation, filters, stride
        self.steps = _operation_steps(operation, filters, stride)

    def build(self, input_shape):
        for step in self.steps:
            step.build(input_shape)
            input_shape = step.compute_output_shape(input_shape)

    def compute_output_shape(self, input_shape):
        for step in self.steps:
            input_shape = step.compute_output_shape(input_shape)
        return input_shape

    def call(self, x, training=False):
        for step in self.steps:
            x = step(x, training=training)
        return x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "operation": self.operation, "filters": self.filters, "stride": self.stride}


def _operation_steps(name: str, filters: int, stride: int) -> list[keras.layers.Layer]:
    """The layers of one genotype operation, applied in order (pooling and identity keep the channels)."""
    quarter = filters // 4
    if name == "none":
        return [] if stride == 1 else [FactorizedReduce(filters)]
    if name in ("max_pool_3x3", "max_pool_2x2"):
        return [keras.layers.MaxPooling2D(int(name[-1]), strides=stride, padding="same")]
    if name == "avg_pool_3x3":  # "same" padding: TensorFlow averages over the valid pixels only
        return [keras.layers.AveragePooling2D(3, strides=stride, padding="same")]
    if name == "conv_1x1":
        return [ReluConvBN(filters, 1, stride)]
    if name == "conv_3x3":
        return [ReluConvBN(quarter, 1), ReluConvBN(quarter, 3, stride), ReluConvBN(filters, 1)]
    if name == "conv_1x7_7x1":
        return [
            ReluConvBN(quarter, 1),
            ReluConvBN(quarter, (1, 7), (1, stride)),
            ReluConvBN(quarter, (7, 1), (stride, 1)),
            ReluConvBN(filters, 1),
        ]
    raise ValueError(
        f"Unknown AmoebaNet operation {name!r}; use one of the names in NORMAL_OPERATIONS or REDUCTION_OPERATIONS."
    )


class AmoebaStem(keras.layers.Layer):
    """3x3/2 convolution and BatchNorm; returns the (previous, current) state pair that cells take."""

    def __init__(self, filters: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv = keras.layers.Conv2D(filters, 3, strides=2, padding="same", use_bias=False)
        self.bn = _batch_norm()

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(self.conv.compute_output_shape(input_shape))

    def compute_output_shape(self, input_shape):
        shape = self.conv.compute_output_shape(input_shape)
        return shape, shape

    def call(self, images, training=False):
        x = self.bn(self.conv(images), training=training)
        return x, x

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters}


class AmoebaCell(keras.layers.Layer):
    """A normal or reduction cell: (previous, current) states in, (current, new) states out.

    ``previous_reduction`` says the previous state has twice the height and width of
    the current one (the cell before was a reduction cell), so it is factorized-reduced.
    Output channels: 4 * filters for a normal cell, 3 * filters for a reduction cell.
    """

    def __init__(self, filters: int, reduction: bool = False, previous_reduction: bool = False, **kwargs: Any):
        if filters % 4:
            raise ValueError(
                f"AmoebaCell(filters={filters}): use a multiple of 4 (its convolutions work on filters/4 channels)."
            )
        super().__init__(**kwargs)
        self.filters, self.reduction, self.previous_reduction = filters, reduction, previous_reduction
        self.preprocess_current = ReluConvBN(filters, 1)
        self.preprocess_previous = FactorizedReduce(filters) if previous_reduction else ReluConvBN(filters, 1)
        genotype = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
        self.sources = [source for source, _ in genotype]
        self.operations = [
            AmoebaOperation(name, filters, 2 if reduction and source < 2 else 1) for source, name in genotype
        ]
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT

    def _hidden_shapes(self, input_shape, build: bool = False) -> list[tuple]:
        previous, current = input_shape
        if build:
            self.preprocess_current.build(current)
            self.preprocess_previous.build(previous)
        hidden = [self.preprocess_current.compute_output_shape(current)] * 2
        for k in range(0, len(self.operations), 2):
            if build:
                for op, source in zip(self.operations[k : k + 2], self.sources[k : k + 2]):
                    op.build(hidden[source])
            hidden.append(self.operations[k].compute_output_shape(hidden[self.sources[k]]))
        return hidden

    # build and compute_output_shape are explicit so that Keras need not trace the cell to get them.
    def build(self, input_shape):
        self._hidden_shapes(input_shape, build=True)

    def compute_output_shape(self, input_shape):
        hidden = self._hidden_shapes(input_shape)
        channels = sum(hidden[i][-1] for i in self.concat)
        return tuple(input_shape[1]), tuple(hidden[-1][:-1]) + (channels,)

    def call(self, states, training=False):
        previous, current = states
        hidden = [
            self.preprocess_current(current, training=training),
            self.preprocess_previous(previous, training=training),
        ]
        for k in range(0, len(self.operations), 2):
            left = self.operations[k](hidden[self.sources[k]], training=training)
            right = self.operations[k + 1](hidden[self.sources[k + 1]], training=training)
            hidden.append(left + right)
        return current, keras.ops.concatenate([hidden[i] for i in self.concat], axis=-1)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "filters": self.filters,
            "reduction": self.reduction,
            "previous_reduction": self.previous_reduction,
        }


class AmoebaHead(keras.layers.Layer):
    """Classifier on the current state: ReLU, global average pooling, Dense logits."""

    def __init__(self, num_classes: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.dense = keras.layers.Dense(num_classes)

    def build(self, input_shape):
        _, current = input_shape
        self.dense.build(self.pool.compute_output_shape(current))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[1][:1]) + (self.num_classes,)

    def call(self, states):
        _, current = states
        return self.dense(self.pool(keras.ops.relu(current)))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "num_classes": self.num_classes}


def amoebanet_d(num_classes: int = 1000, num_layers: int = 18, num_filters: int = 256) -> list[keras.layers.Layer]:
    """Layers of AmoebaNet-D (L=num_layers, D=num_filters): stem, cells, head; train with ``amoebanet_loss()``.

    As in GPipe and torchgpipe: a 3x3/2 stem with D/4 filters and two reduction cells
    (D/2, D) bring 224x224 images to 28x28; then three stacks of L/3 normal cells with
    reduction cells (2D, 4D) between them. Every reduction halves height and width and
    doubles the filters. Unlike torchgpipe, the stem has no ReLU on the raw image, and
    max_pool operations are max pooling (torchgpipe averages there; no parameters change).
    """
    if num_layers < 3 or num_layers % 3:
        raise ValueError(
            f"num_layers={num_layers}: AmoebaNet-D needs a positive multiple of 3 (L/3 normal cells "
            "per stack), e.g. 18."
        )
    if num_filters < 8 or num_filters % 8:
        raise ValueError(
            f"num_filters={num_filters}: use a positive multiple of 8 (the first cells work on D/2 "
            "filters, their operations on a quarter of those), e.g. 256."
        )
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be a positive integer.")
    normal = [False] * (num_layers // 3)
    plan = [True, True] + normal + [True] + normal + [True] + normal  # True: a reduction cell
    filters = num_filters // 4
    layers: list[keras.layers.Layer] = [AmoebaStem(filters)]
    previous_reduction = False
    for reduction in plan:
        filters *= 2 if reduction else 1
        layers.append(AmoebaCell(filters, reduction, previous_reduction))
        previous_reduction = reduction
    return layers + [AmoebaHead(num_classes)]


def amoebanet_loss() -> keras.losses.Loss:
    """The loss for ``amoebanet_d`` logits and integer class labels."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
