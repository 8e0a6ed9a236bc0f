"""Reference models: parameter counts against published figures, pipelined training, clones from config."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.util import covering, cpu_devices, max_rel_error
from tfpipe.models.amoebanet import PointwiseConv, amoebanet_d, amoebanet_loss
from tfpipe.models.resnet import resnet, resnet_loss
from tfpipe.models.transformer import transformer_lm, transformer_loss

IMAGE = (32, 32, 3)
VOCAB, LENGTH = 20, 8


def tiny_resnet():
    return resnet(num_classes=5, width=4, stage_blocks=(1, 1, 1, 1))


def tiny_amoebanet():
    return amoebanet_d(num_classes=5, num_layers=3, num_filters=16)


def tiny_transformer(**options):
    return transformer_lm(VOCAB, LENGTH, 2, 16, 32, 2, **options)


# name -> (layers, input shape, input dtype, loss)
MODELS = {
    "resnet": (tiny_resnet, IMAGE, "float32", resnet_loss),
    "amoebanet": (tiny_amoebanet, IMAGE, "float32", amoebanet_loss),
    "transformer": (lambda: tiny_transformer(logit_clip=15.0, scaled_init=True), (LENGTH,), "int32", transformer_loss),
}


def _data(name, n=8, seed=0):
    rng = np.random.default_rng(seed)
    if name == "transformer":
        x = rng.integers(0, VOCAB, size=(n, LENGTH)).astype("int32")
        return x, np.roll(x, -1, axis=1)
    return rng.normal(size=(n, *IMAGE)).astype("float32"), rng.integers(0, 5, size=n)


def _sequential(layers, shape, dtype="float32"):
    return keras.Sequential([keras.Input(shape, dtype=dtype), *layers])


def _trainable_count(net):
    return sum(int(np.prod(v.shape)) for v in net.trainable_weights)


# Parameter counts ------------------------------------------------------------------------------


# keras.applications.ResNet50/ResNet101(weights=None).count_params() (include_top=True, Keras 3.15):
# 25,636,712 and 44,707,176. Without the convolution biases and BatchNorm moving statistics they are
# torchvision's published resnet50/resnet101 sizes 25,557,032 and 44,549,160 (its convolutions have no bias).
@pytest.mark.parametrize(
    "depth, keras_total, without_conv_bias", [(50, 25_636_712, 25_557_032), (101, 44_707_176, 44_549_160)]
)
def test_resnet_parameter_count(depth, keras_total, without_conv_bias):
    net = _sequential(resnet(depth), (224, 224, 3))
    assert net.count_params() == keras_total
    conv_biases = sum(int(np.prod(v.shape)) for v in net.trainable_weights if v.path.endswith("conv/bias"))
    assert _trainable_count(net) - conv_biases == without_conv_bias


def test_resnet50_equals_keras_applications():
    """Same layers as keras.applications.ResNet50: its weights load by name and give the same logits."""
    ours = _sequential(resnet(50), IMAGE)
    theirs = keras.applications.ResNet50(weights=None, input_shape=IMAGE, classifier_activation=None)
    by_name = {v.path: v for v in theirs.weights}
    rng = np.random.default_rng(0)
    for v in ours.weights:
        parts = v.path.split("/")[1:]  # "sequential/conv2_block1/1_bn/gamma" -> "conv2_block1_1_bn/gamma"
        theirs_v = by_name.pop("_".join(parts[:-1]) + "/" + parts[-1])
        value = rng.uniform(0.5, 1.5, v.shape) if "variance" in v.path else rng.normal(0, 0.05, v.shape)
        theirs_v.assign(value.astype("float32"))
        v.assign(value.astype("float32"))
    assert not by_name
    x = rng.normal(size=(2, *IMAGE)).astype("float32")
    np.testing.assert_allclose(ours(x, training=False), theirs(x, training=False), rtol=1e-5, atol=1e-6)


def amoebanet_parameters(num_layers, num_filters, num_classes, per_batch_norm_channel):
    """AmoebaNet-D's parameter count summed op by op (independently of models/amoebanet.py)."""

    def bn(c):
        return per_batch_norm_channel * c

    def relu_conv_bn(c_in, c_out, kernel=1):
        return kernel * c_in * c_out + bn(c_out)

    def factorized_reduce(c_in, c_out):
        return 2 * c_in * (c_out // 2) + bn(c_out)

    def conv_3x3(c):
        return relu_conv_bn(c, c // 4) + relu_conv_bn(c // 4, c // 4, 9) + relu_conv_bn(c // 4, c)

    def conv_1x7_7x1(c):
        return relu_conv_bn(c, c // 4) + 2 * relu_conv_bn(c // 4, c // 4, 7) + relu_conv_bn(c // 4, c)

    normal_ops = lambda c: 3 * relu_conv_bn(c, c) + 2 * conv_1x7_7x1(c)  # noqa: E731
    reduction_ops = lambda c: conv_3x3(c) + conv_1x7_7x1(c) + relu_conv_bn(c, c)  # noqa: E731
    c = num_filters // 4
    total = relu_conv_bn(3, c, 9)  # stem: 3x3 convolution and BatchNorm
    prev_prev, prev, prev_reduction = c, c, False
    normal = [False] * (num_layers // 3)
    for reduction in [True, True] + normal + [True] + normal + [True] + normal:
        c *= 2 if reduction else 1
        total += relu_conv_bn(prev, c)
        total += factorized_reduce(prev_prev, c) if prev_reduction else relu_conv_bn(prev_prev, c)
        total += reduction_ops(c) if reduction else normal_ops(c)
        prev_prev, prev, prev_reduction = prev, c * (3 if reduction else 4), reduction
    return total + prev * num_classes + num_classes


# torchgpipe's benchmarks/amoebanetd-memory/README.md gives the sizes of the models of GPipe's Table 1
# (PyTorch parameters: BatchNorm's scale and offset, not its moving statistics), 1000 classes.
@pytest.mark.parametrize(
    "num_layers, num_filters, published, last_digit",
    [
        (18, 208, 81.5e6, 0.1e6),
        (18, 416, 319.0e6, 0.1e6),
        (18, 544, 542.7e6, 0.1e6),
        (36, 544, 1.06e9, 0.01e9),
        (72, 512, 1.84e9, 0.01e9),
    ],
)
def test_amoebanet_formula_matches_published_sizes(num_layers, num_filters, published, last_digit):
    assert abs(amoebanet_parameters(num_layers, num_filters, 1000, 2) - published) <= last_digit / 2


@pytest.mark.parametrize("num_layers, num_filters", [(3, 16), (6, 32)])
def test_amoebanet_parameter_count(num_layers, num_filters):
    net = _sequential(amoebanet_d(1000, num_layers, num_filters), IMAGE)
    assert net.count_params() == amoebanet_parameters(num_layers, num_filters, 1000, 4)
    assert _trainable_count(net) == amoebanet_parameters(num_layers, num_filters, 1000, 2)


@pytest.mark.parametrize("size", [31, 32])
def test_a_strided_pointwise_conv_gives_a_strided_conv2ds_values_and_gradients(size):
    x = tf.random.stateless_normal((2, size, size, 8), seed=(1, 2))
    conv = PointwiseConv(6, 2)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = conv(x)
        ref = tf.nn.conv2d(x, conv.conv.kernel, strides=2, padding="SAME")
    assert y.shape == ref.shape == conv.compute_output_shape(x.shape) == (2, 16, 16, 6)
    np.testing.assert_allclose(y, ref, atol=1e-6)
    for got, want in zip(tape.gradient(y, [x, conv.conv.kernel]), tape.gradient(ref, [x, conv.conv.kernel])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # sums of 512 products: rounding


def test_amoebanet_trains_on_one_image():
    # a reduction cell's 1x1 stride-2 convolutions: TensorFlow 2.21's oneDNN kernel of that gradient crashed the
    # process on one image of 8 channels, which tfpipe.plan measures (a micro-batch of one row)
    net = _sequential(amoebanet_d(5, 3, 32), IMAGE)
    x = tf.random.stateless_uniform((1, *IMAGE), seed=(3, 4))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(net(x, training=True))
    grads = tape.gradient(loss, net.trainable_variables)
    assert all(g is not None and np.isfinite(g).all() for g in grads)


def transformer_parameters(vocab, length, blocks, dim, hidden):
    """Embeddings, per block two LayerNorms + attention (4 d x d and biases) + feed-forward, norm, projection."""
    block = 2 * 2 * dim + 4 * (dim * dim + dim) + (dim * hidden + hidden) + (hidden * dim + dim)
    return vocab * dim + length * dim + blocks * block + 2 * dim + dim * vocab + vocab


@pytest.mark.parametrize("options", [{}, {"logit_clip": 15.0, "scaled_init": True}])
def test_transformer_parameter_count(options):
    net = _sequential(transformer_lm(50, 12, 3, 32, 48, 4, **options), (12,), "int32")
    assert net.count_params() == transformer_parameters(50, 12, 3, 32, 48)


# Transformer options (GPipe section 5) -------------------------------------------------------------


def test_logit_clip_bounds_the_logits():
    net = _sequential(tiny_transformer(logit_clip=0.01), (LENGTH,), "int32")
    net.layers[-1].set_weights([w * 1e3 for w in net.layers[-1].get_weights()])
    logits = np.asarray(net(_data("transformer")[0]))
    assert np.abs(logits).max() == pytest.approx(0.01)


def test_scaled_init_divides_feed_forward_weights_by_the_depth():
    keras.utils.set_random_seed(0)
    plain = _sequential(transformer_lm(VOCAB, LENGTH, 4, 32, 64, 2), (LENGTH,), "int32")
    scaled = _sequential(transformer_lm(VOCAB, LENGTH, 4, 32, 64, 2, scaled_init=True), (LENGTH,), "int32")
    for a, b in zip(plain.layers[1:5], scaled.layers[1:5]):
        for dense in ("up", "down"):
            ratio = np.std(getattr(b, dense).kernel) / np.std(getattr(a, dense).kernel)
            assert ratio == pytest.approx(1 / 4, rel=0.1)
        attention = np.std(b.attention.get_weights()[0]) / np.std(a.attention.get_weights()[0])
        assert attention == pytest.approx(1.0, rel=0.1)  # only the feed-forward layers are scaled


# Training under PipelineModel ------------------------------------------------------------------------


# Training runs eagerly, which runs the same pipeline code: tracing the first graph-mode step costs 10-40 s
# on this 2-core machine (a 2-block Transformer at K=4, M=4: ~11 s; the tiny AmoebaNet-D: up to ~40 s).
# The one-step comparisons with keras.Sequential below run in graph mode where that is affordable.
def _fit(name, k, m, epochs=1, optimizer=None):
    make, shape, dtype, loss = MODELS[name]
    x, y = _data(name)
    keras.utils.set_random_seed(0)
    model = tfpipe.PipelineModel(make(), num_partitions=k, devices=cpu_devices(k), num_micro_batches=m)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss=loss(), run_eagerly=True)
    return model.fit(x, y, batch_size=len(x), epochs=epochs, shuffle=False, verbose=0).history["loss"]


@pytest.mark.parametrize(
    "name, k, m",
    covering(
        [(n, *km) for n in ("resnet", "amoebanet") for km in [(1, 2), (4, 4)]], [("resnet", 4, 4), ("amoebanet", 1, 2)]
    ),
)
def test_conv_nets_train_pipelined(name, k, m):
    losses = _fit(name, k, m)
    assert np.all(np.isfinite(losses))


@pytest.mark.slow  # scripts/train.py's default run lowers the Transformer's loss (tests/scripts/test_train_script.py)
@pytest.mark.parametrize("k, m", [(1, 2), (4, 4)])
def test_transformer_training_lowers_the_loss(k, m):
    losses = _fit("transformer", k, m, epochs=6, optimizer=keras.optimizers.Adam(0.01))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses


# BatchNorm uses each micro-batch's statistics, so the conv nets match plain Keras only with M=1.
# The AmoebaNet-D comparison runs eagerly (see _fit).
@pytest.mark.parametrize(  # ResNet and AmoebaNet train pipelined in test_conv_nets_train_pipelined
    "name, m, eager",
    covering(
        [("resnet", 1, False), ("amoebanet", 1, True), ("transformer", 2, False)],
        [("transformer", 2, False)],
    ),
)
def test_one_step_matches_sequential(name, m, eager):
    make, shape, dtype, loss = MODELS[name]
    x, y = _data(name)
    keras.utils.set_random_seed(0)
    reference = _sequential(make(), shape, dtype)
    start = reference.get_weights()
    model = tfpipe.PipelineModel(make(), num_partitions=2, devices=cpu_devices(2), num_micro_batches=m)
    model.build((None, *shape))
    model.set_weights(start)
    for net in (reference, model):
        net.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss(), run_eagerly=eager)
        net.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    assert max_rel_error(start, reference.get_weights()) > 1e-3  # the step did change the weights
    # Relative to each tensor's scale. The absolute 1e-6 is for biases whose gradient is exactly zero, so
    # that after the step they hold only rounding noise: attention key biases (softmax ignores a per-query
    # constant; ~1e-10) and convolution biases before a BatchNorm (it subtracts the batch mean; ~1e-7 here,
    # and its pattern changes with the order of float sums, e.g. tfpipe's CPU MatMul gradient layout).
    for got, want in zip(model.get_weights(), reference.get_weights()):
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want)) + 1e-6


# Clones from config (tfpipe copies layers to estimate their costs) --------------------------------------


def _custom(layers):
    """Every layer defined in models/, top-level or nested."""
    return [
        sub
        for layer in layers
        for sub in layer._flatten_layers(include_self=True)
        if type(sub).__module__.startswith("tfpipe.models.")
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_custom_layers_clone_from_config(name):
    make, shape, dtype, _ = MODELS[name]
    layers = make()
    original = _sequential(layers, shape, dtype)
    assert _custom(layers)
    for layer in _custom(layers):
        clone = type(layer).from_config(layer.get_config())
        assert not clone.built
        assert clone.get_config() == layer.get_config()
    clones = _sequential([type(layer).from_config(layer.get_config()) for layer in layers], shape, dtype)
    assert [c.count_params() for c in clones.layers] == [o.count_params() for o in original.layers]
    assert clones.output_shape == original.output_shape


# Bad arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: resnet(34), "depth=34"),
        (lambda: resnet(50, stage_blocks=(3, 0)), "stage_blocks"),
        (lambda: amoebanet_d(num_layers=4), "num_layers=4"),
        (lambda: amoebanet_d(num_filters=100), "num_filters=100"),
        (lambda: tiny_transformer(logit_clip=-1.0), "logit_clip=-1.0"),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()
