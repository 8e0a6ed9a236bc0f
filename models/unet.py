"""U-Net (torchgpipe's second benchmark model) as a Functional keras.Model: its skips cross the cells' cuts."""

from __future__ import annotations

import keras


def _convs(x: keras.KerasTensor, filters: int, num_convs: int, name: str) -> keras.KerasTensor:
    """``num_convs`` 3x3 convolutions with BatchNorm and ReLU."""
    for k in range(num_convs):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv{k}")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn{k}")(x)
        x = keras.layers.ReLU(name=f"{name}_relu{k}")(x)
    return x


def unet(
    input_shape: tuple[int, int, int] = (64, 64, 3),
    output_channels: int = 1,
    depth: int = 5,
    num_convs: int = 5,
    base_channels: int = 64,
    batch_norm: bool = True,
    name: str = "unet",
) -> keras.Model:
    """A U-Net: ``depth`` down stages (max pooling) and as many up stages (upsampling), each of
    ``num_convs`` 3x3 convolutions; channels double per stage from ``base_channels``; each up stage
    concatenates the skip of the down stage at its scale. torchgpipe benchmarks depth 5,
    5 convolutions, 64 base channels. ``batch_norm=False`` leaves BatchNormalization out (a
    batch-independent model, exact at any number of micro-batches).
    """
    for arg, value in (("depth", depth), ("num_convs", num_convs), ("base_channels", base_channels)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"unet: {arg} must be a positive int, got {value!r}.")
    height, width = input_shape[0], input_shape[1]
    if height % 2**depth or width % 2**depth:
        raise ValueError(
            f"unet: input {height}x{width} must be divisible by 2**depth = {2**depth} for the skips to line up; "
            "pick another size or a smaller depth."
        )
    convs = _convs if batch_norm else _plain_convs
    inputs = keras.Input(input_shape, name="image")
    x, skips = inputs, []
    for level in range(depth):
        x = convs(x, base_channels * 2**level, num_convs, f"down{level}")
        skips.append(x)
        x = keras.layers.MaxPooling2D(name=f"down{level}_pool")(x)
    x = convs(x, base_channels * 2**depth, num_convs, "middle")
    for level in reversed(range(depth)):
        x = keras.layers.UpSampling2D(name=f"up{level}_upsample")(x)
        x = keras.layers.Concatenate(name=f"up{level}_concat")([x, skips[level]])
        x = convs(x, base_channels * 2**level, num_convs, f"up{level}")
    outputs = keras.layers.Conv2D(output_channels, 1, name="logits")(x)
    return keras.Model(inputs, outputs, name=name)


def _plain_convs(x: keras.KerasTensor, filters: int, num_convs: int, name: str) -> keras.KerasTensor:
    """``num_convs`` 3x3 convolutions with ReLU."""
    for k in range(num_convs):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"{name}_conv{k}")(x)
    return x
