"""What THOR preconditions in common architectures, and how it says so.

For a small zoo, the preconditioned share of the trainable parameters
(`keras_thor.curvature_coverage`) now, and under the rule of keras_thor
before curvature blocks ("before"): only the exact Keras classes `Dense`,
`Conv2D` with `groups=1`, `Embedding` and `LayerNormalization`, found in
the model's config (so neither subclasses nor MultiHeadAttention's
projections), preconditioned their kernel, table, or scale and offset.
"""

import math
import warnings

import keras
import numpy as np
import pytest

import keras_thor


@keras.saving.register_keras_serializable(package="coverage_test")
class MyDense(keras.layers.Dense):
    """A user's Dense subclass that keeps `Dense.call`."""

    def __init__(self, units, note="", **kwargs):
        super().__init__(units, **kwargs)
        self.note = note

    def get_config(self):
        return {**super().get_config(), "note": self.note}


@keras.saving.register_keras_serializable(package="coverage_test")
class ClippedDense(keras.layers.Dense):
    """A user's Dense subclass that overrides `call`."""

    def call(self, inputs):
        return keras.ops.clip(super().call(inputs), -1.0, 1.0)


def _size(variable):
    return math.prod(variable.shape)


def _config_layers(model):
    """The layers the old conversion saw: those of the model's config,
    into nested Sequential and Functional models, not into other layers."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _config_layers(layer)


def _before(model):
    """Trainable parameters the old keras_thor preconditioned."""
    layers = keras.layers
    covered = 0
    for layer in _config_layers(model):
        kind = type(layer)
        if kind is layers.Dense:
            covered += _size(layer.kernel)
        elif kind is layers.Conv2D and layer.groups == 1:
            covered += _size(layer.kernel)
        elif kind is layers.Embedding:
            covered += _size(layer.embeddings)
        elif kind is layers.LayerNormalization:
            covered += sum(
                _size(v) for v in (layer.gamma, layer.beta) if v is not None
            )
    return covered


def _trainable(model):
    return sum(_size(v) for v in model.trainable_weights)


# The zoo.


def _conv1d_net():
    return keras.Sequential(
        [
            keras.Input((32, 3)),
            keras.layers.Conv1D(16, 3, activation="relu", name="conv_a"),
            keras.layers.Conv1D(16, 3, activation="relu", name="conv_b"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(4, name="head"),
        ],
        name="conv1d_net",
    )


def _mobilenet_v2():
    return keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=10
    )


def _transformer():
    layers = keras.layers
    tokens = keras.Input((12,), dtype="int32")
    x = layers.Embedding(50, 16, name="embedding")(tokens)
    attended = layers.MultiHeadAttention(2, 8, name="attention")(x, x)
    x = layers.LayerNormalization(name="norm_a")(layers.Add()([x, attended]))
    hidden = layers.Dense(32, activation="relu", name="ffn_in")(x)
    hidden = layers.Dense(16, name="ffn_out")(hidden)
    x = layers.LayerNormalization(name="norm_b")(layers.Add()([x, hidden]))
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(4, name="head")(x)
    return keras.Model(tokens, outputs, name="transformer")


def _gpt(tie_weights=True):
    """A pre-LayerNorm GPT block, bias-free, its head the token table."""
    layers = keras.layers
    tokens = keras.Input((12,), dtype="int32")
    table = layers.ReversibleEmbedding(
        50, 16, tie_weights=tie_weights, name="token_embedding"
    )
    x = table(tokens)
    h = layers.LayerNormalization(center=False, name="norm_a")(x)
    h = layers.MultiHeadAttention(2, 8, use_bias=False, name="attention")(
        h, h, use_causal_mask=True
    )
    x = layers.Add()([x, h])
    h = layers.LayerNormalization(center=False, name="norm_b")(x)
    h = layers.Dense(32, "gelu", use_bias=False, name="ffn_in")(h)
    x = layers.Add()([x, layers.Dense(16, use_bias=False, name="ffn_out")(h)])
    x = layers.LayerNormalization(center=False, name="norm_f")(x)
    return keras.Model(tokens, table(x, reverse=True), name="gpt")


def _separable_grouped():
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu", name="stem"),
            keras.layers.Conv2D(8, 3, groups=2, name="grouped"),
            keras.layers.DepthwiseConv2D(3, name="depthwise"),
            keras.layers.SeparableConv2D(16, 3, name="separable"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4, name="head"),
        ],
        name="separable_grouped",
    )


def _user_dense():
    return keras.Sequential(
        [
            keras.Input((10,)),
            MyDense(32, activation="relu", note="mine", name="mine_a"),
            MyDense(16, note="mine", name="mine_b"),
            keras.layers.Dense(4, name="head"),
        ],
        name="user_dense",
    )


# (build, trainable parameters, preconditioned before, after). Biases and
# BatchNormalization stay first-order.
ZOO = {
    # 6.3% -> 96.4%: Conv1D kernels are new.
    "conv1d_net": (_conv1d_net, 1_012, 64, 976),
    # 90.8% -> 96.6%: the 17 DepthwiseConv2D kernels are new.
    "mobilenet_v2": (_mobilenet_v2, 408_938, 371_376, 394_848),
    # 63.1% -> 96.2%: MultiHeadAttention's four projections are new.
    "transformer": (_transformer, 3_092, 1_952, 2_976),
    # 37.0% -> 100%: attention's projections and the tied token table (its
    # lookup and the vocabulary head) are new.
    "gpt": (_gpt, 2_896, 1_072, 2_896),
    # 31.7% -> 95.0%: grouped, depthwise and separable kernels are new.
    "separable_grouped": (_separable_grouped, 884, 280, 840),
    # 6.8% -> 94.5%: the user's Dense subclass is new.
    "user_dense": (_user_dense, 948, 64, 896),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_coverage_before_and_after(name):
    build, parameters, before, after = ZOO[name]
    base = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras_thor.convert_to_thor_model(base)
    coverage = keras_thor.curvature_coverage(model)
    table = (
        f"{name}: {coverage.parameters:,} trainable parameters, "
        f"preconditioned before {_before(base):,} "
        f"({_before(base) / coverage.parameters:.1%}), after "
        f"{coverage.curvature_parameters:,} ({coverage.share:.1%})"
    )
    assert coverage.share >= 0.9, table
    assert _trainable(base) == coverage.parameters == parameters, table
    assert _before(base) == before, table
    assert coverage.curvature_parameters == after, table
    # Warned about first-order layers exactly when there are some.
    first_order = [w for w in caught if "first-order" in str(w.message)]
    assert len(first_order) == (1 if coverage.first_order else 0), table


def test_zoo_layers_are_covered_by_kind():
    rules = {
        row.name: row.rule
        for row in keras_thor.curvature_coverage(_transformer()).layers
    }
    assert rules == {
        "embedding": "EmbeddingKronecker",
        "query": "EinsumDenseKronecker",
        "key": "EinsumDenseKronecker",
        "value": "EinsumDenseKronecker",
        "attention_output": "EinsumDenseKronecker",
        "norm_a": "NormalizationDiagonal",
        "ffn_in": "DenseKronecker",
        "ffn_out": "DenseKronecker",
        "norm_b": "NormalizationDiagonal",
        "head": "DenseKronecker",
    }
    rules = {
        row.name: row.rule
        for row in keras_thor.curvature_coverage(_gpt()).layers
    }
    assert rules["token_embedding"] == "TiedEmbeddingKronecker"
    assert rules["query"] == "EinsumDenseKronecker"
    untied = keras_thor.curvature_coverage(_gpt(tie_weights=False))
    [row] = [row for row in untied.layers if row.name == "token_embedding"]
    assert row.rule == "DenseKronecker, EmbeddingKronecker"
    assert row.curvature_parameters == row.parameters == 2 * 50 * 16
    rules = {
        row.name: row.rule
        for row in keras_thor.curvature_coverage(_separable_grouped()).layers
    }
    assert rules == {
        "stem": "ConvKronecker",
        "grouped": "ConvKronecker",
        "depthwise": "ConvKronecker",
        "separable": "ConvKronecker",
        "head": "DenseKronecker",
    }


def _with_clipped_dense():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(6, name="plain"),
            ClippedDense(4, name="clipped"),
            keras.layers.Dense(2, name="head"),
        ],
        name="clipped_net",
    )


def test_a_dense_subclass_that_overrides_call_stays_first_order():
    coverage = keras_thor.curvature_coverage(_with_clipped_dense())
    rows = {row.name: row for row in coverage.layers}
    clipped = rows["clipped"]
    assert clipped.class_name == "ClippedDense"
    assert clipped.curvature_parameters == 0
    assert clipped.parameters == 6 * 4 + 4
    assert "overrides `call`" in clipped.rule
    assert clipped.rule.startswith("first-order")
    assert [row.name for row in coverage.first_order] == ["clipped"]
    assert rows["plain"].rule == rows["head"].rule == "DenseKronecker"


def test_conversion_warns_naming_first_order_layers_and_their_size():
    with pytest.warns(
        UserWarning,
        match=r"1 ClippedDense \(28 parameters; ClippedDense overrides "
        r"`call` of Dense\): clipped",
    ):
        base = _with_clipped_dense()
        model = keras_thor.convert_to_thor_model(base)
    assert model is base


def test_conversion_of_a_model_with_nothing_to_precondition_raises():
    base = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.PReLU(name="prelu"),
        ]
    )
    with pytest.raises(
        ValueError,
        match=r"none of the layers.*Layer types with trainable weights: "
        r"\[('\w+', )*'BatchNormalization', ('\w+', )*'PReLU'\]",
    ):
        keras_thor.convert_to_thor_model(base)


def test_coverage_table_names_every_layer_and_ends_with_the_summary():
    coverage = keras_thor.curvature_coverage(_with_clipped_dense())
    text = str(coverage)
    for name in ("plain", "clipped", "head"):
        assert name in text
    lines = text.splitlines()
    assert lines[-1] == coverage.summary()
    assert lines[-1] == (
        "THOR preconditions 2 of 3 layers with trainable weights: "
        "56 of 92 trainable parameters (60.9%)."
    )
    assert len(lines) == 1 + 3 + 1  # header, rows, summary


def test_thor_on_an_unconverted_keras_model_says_to_convert():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, name="d")]
    )
    model.compile(
        optimizer=keras_thor.optimizers.THOR(0.1, damping=0.1, momentum=0.9),
        loss="mse",
    )
    x = np.zeros((4, 4), "float32")
    y = np.zeros((4, 2), "float32")
    with pytest.raises(ValueError, match="convert_to_thor_model"):
        model.fit(x, y, verbose=0)
