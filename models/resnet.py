"""ResNet-50/101 v1, as keras.applications builds it, as a list of layers: stem, one bottleneck per layer, head."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

BN_EPSILON = 1.001e-5  # keras.applications' value
STAGE_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


def _batch_norm(name: str) -> keras.layers.BatchNormalization:
    return keras.layers.BatchNormalization(axis=-1, epsilon=BN_EPSILON, name=name)


class ResNetStem(keras.layers.Layer):
    """7x7/2 convolution, BatchNorm, ReLU and 3x3/2 max pooling (224x224 in, 56x56 out)."""

    def __init__(self, filters: int = 64, **kwargs: Any):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv_pad = keras.layers.ZeroPadding2D(3, name="conv_pad")
        self.conv = keras.layers.Conv2D(filters, 7, strides=2, name="conv")
        self.bn = _batch_norm("bn")
        self.pool_pad = keras.layers.ZeroPadding2D(1, name="pool_pad")
        self.pool = keras.layers.MaxPooling2D(3, strides=2, name="pool")

    def build(self, input_shape):
        shape = self.conv_pad.compute_output_shape(input_shape)
        self.conv.build(shape)
        self.bn.build(self.conv.compute_output_shape(shape))

    def compute_output_shape(self, input_shape):
        for layer in (self.conv_pad, self.conv, self.pool_pad, self.pool):
            input_shape = layer.compute_output_shape(input_shape)
        return input_shape

    def call(self, x, training=False):
        x = keras.ops.relu(self.bn(self.conv(self.conv_pad(x)), training=training))
        return self.pool(self.pool_pad(x))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters}


class Bottleneck(keras.layers.Layer):
    """v1 bottleneck block: 1x1 (strided) -> 3x3 -> 1x1 to 4*filters, BatchNorm after each, shortcut add, ReLU.

    ``projection`` puts a strided 1x1 convolution and BatchNorm on the shortcut; it
    is needed whenever the block changes the shape (stride 2 or new channel count).
    """

    expansion = 4

    def __init__(self, filters: int, strides: int = 1, projection: bool = False, **kwargs: Any):
        if strides != 1 and not projection:
            raise ValueError(f"Bottleneck(strides={strides}) changes the shape, so it needs projection=True.")
        super().__init__(**kwargs)
        self.filters, self.strides, self.projection = filters, strides, projection
        out = self.expansion * filters
        if projection:  # created first, so weights are ordered as in keras.applications
            self.shortcut_conv = keras.layers.Conv2D(out, 1, strides=strides, name="0_conv")
            self.shortcut_bn = _batch_norm("0_bn")
        self.conv1 = keras.layers.Conv2D(filters, 1, strides=strides, name="1_conv")
        self.bn1 = _batch_norm("1_bn")
        self.conv2 = keras.layers.Conv2D(filters, 3, padding="same", name="2_conv")
        self.bn2 = _batch_norm("2_bn")
        self.conv3 = keras.layers.Conv2D(out, 1, name="3_conv")
        self.bn3 = _batch_norm("3_bn")

    # build and compute_output_shape are explicit so that Keras need not trace the block to get them.
    def build(self, input_shape):
        pairs = [(self.conv1, self.bn1), (self.conv2, self.bn2), (self.conv3, self.bn3)]
        if self.projection:
            self.shortcut_conv.build(input_shape)
            self.shortcut_bn.build(self.shortcut_conv.compute_output_shape(input_shape))
        shape = input_shape
        for conv, bn in pairs:
            conv.build(shape)
            shape = conv.compute_output_shape(shape)
            bn.build(shape)

    def compute_output_shape(self, input_shape):
        for conv in (self.conv1, self.conv2, self.conv3):
            input_shape = conv.compute_output_shape(input_shape)
        return input_shape

    def call(self, x, training=False):
        shortcut = self.shortcut_bn(self.shortcut_conv(x), training=training) if self.projection else x
        y = keras.ops.relu(self.bn1(self.conv1(x), training=training))
        y = keras.ops.relu(self.bn2(self.conv2(y), training=training))
        y = self.bn3(self.conv3(y), training=training)
        return keras.ops.relu(shortcut + y)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters, "strides": self.strides, "projection": self.projection}


def _stage_blocks(depth: int, stage_blocks: Sequence[int] | None) -> tuple[int, ...]:
    if stage_blocks is not None:
        blocks = tuple(stage_blocks)
        if not blocks or any(not isinstance(b, int) or b < 1 for b in blocks):
            raise ValueError(f"stage_blocks={stage_blocks!r}: give one positive integer per stage, e.g. (3, 4, 6, 3).")
        return blocks
    if depth not in STAGE_BLOCKS:
        raise ValueError(f"depth={depth!r} is not supported; use 50 or 101 (or give stage_blocks=...).")
    return STAGE_BLOCKS[depth]


def resnet(
    depth: int = 50, num_classes: int = 1000, width: int = 64, stage_blocks: Sequence[int] | None = None
) -> list[keras.layers.Layer]:
    """Layers of ResNet-``depth`` (v1): stem, one bottleneck block per layer, global average pool, Dense logits.

    ``width`` is the stem's filter count (64 in the paper; stage s uses width * 2**s);
    ``stage_blocks`` overrides the blocks per stage that ``depth`` implies (for tiny test models).
    The Dense layer outputs logits: train with ``resnet_loss()``.
    """
    if num_classes < 1 or width < 1:
        raise ValueError(f"num_classes={num_classes} and width={width} must be positive integers.")
    layers: list[keras.layers.Layer] = [ResNetStem(width, name="conv1")]
    for stage, count in enumerate(_stage_blocks(depth, stage_blocks)):
        filters = width * 2**stage
        for block in range(count):
            strides = 2 if block == 0 and stage > 0 else 1
            layers.append(Bottleneck(filters, strides, projection=block == 0, name=f"conv{stage + 2}_block{block + 1}"))
    return layers + [
        keras.layers.GlobalAveragePooling2D(name="avg_pool"),
        keras.layers.Dense(num_classes, name="predictions"),
    ]


def resnet_loss() -> keras.losses.Loss:
    """The loss for ``resnet`` logits and integer class labels."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
