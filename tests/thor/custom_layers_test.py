"""Users' unregistered layers and `Lambda` layers: converted in place
(`convert_to_thor_model`, `to_boost_model`), THOR training, `.keras`
files, and through the rebuild that remains (`to_keras_model` of
keras_thor's model classes) with its one-line refusals."""

import keras
import numpy as np
import pytest

import keras_thor
from tests import helpers


class MyDense(keras.layers.Dense):
    """A user's Dense subclass, not registered."""


class Scale(keras.layers.Layer):
    """A user's plain layer, not registered."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def add_one(x):
    return keras.ops.add(x, 1.0)


# What loading a `.keras` file of these models needs.
CUSTOM_OBJECTS = {"MyDense": MyDense, "Scale": Scale, "add_one": add_one}


def _blocks():
    """The custom layers and Lambdas every model below holds."""
    init = keras.initializers.GlorotUniform(seed=0)
    return [
        MyDense(5, activation="tanh", kernel_initializer=init, name="mine"),
        Scale(0.5, name="scale"),
        keras.layers.Lambda(lambda x: x * 2.0, name="double"),
        keras.layers.Lambda(add_one, name="add_one"),
    ]


def _model(kind):
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(2, activation=add_one, name="head")
    if kind == "sequential":
        return keras.Sequential([keras.Input((4,)), *_blocks(), head])
    inputs = keras.Input((4,))
    if kind == "functional":
        hidden = inputs
        for layer in _blocks():
            hidden = layer(hidden)
    else:
        inner = keras.Sequential([keras.Input((4,)), *_blocks()], name="inner")
        hidden = inner(inputs)
    return keras.Model(inputs, head(hidden))


def _custom_layers(model):
    return {
        layer.name: layer
        for layer in [model, *model.layers]
        + [
            inner
            for layer in model.layers
            if isinstance(layer, keras.Model)
            for inner in layer.layers
        ]
    }


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 4)).astype("float32")
    y = rng.normal(size=(37, 2)).astype("float32")
    return x, y


def _fit(model, x, y):
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


@pytest.mark.thor_training
@pytest.mark.parametrize("kind", ["sequential", "functional", "nested"])
def test_convert_fit_save_and_load(kind, tmp_path):
    model = _model(kind)
    x, y = _data()
    converted = keras_thor.convert_to_thor_model(model)
    layers = _custom_layers(converted)
    assert type(layers["mine"]) is MyDense
    assert type(layers["scale"]) is Scale and layers["scale"].factor == 0.5
    assert layers["add_one"].function is add_one
    coverage = {
        row.name: row for row in keras_thor.curvature_coverage(converted).layers
    }
    assert coverage["mine"].curvature_parameters == 4 * 5
    np.testing.assert_allclose(
        converted.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )

    converted.compile(
        optimizer=keras_thor.optimizers.THOR(0.05, 0.3, 0.9, frequency=2),
        loss="mse",
    )
    _fit(converted, x, y)
    path = tmp_path / "model.keras"
    converted.save(path)
    # Keras stores a Python lambda as bytecode: loading it needs
    # `safe_mode=False` (and the lambda must not use module globals).
    loaded = keras_thor.load_model(
        path, custom_objects=CUSTOM_OBJECTS, safe_mode=False
    )
    assert type(loaded) is type(converted)
    assert type(_custom_layers(loaded)["mine"]) is MyDense
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), converted.predict(x, verbose=0), atol=1e-6
    )
    helpers.assert_same_training_state(loaded, converted, atol=0, rtol=0)
    if kind == "nested":  # Resumed training equals uninterrupted training.
        _fit(converted, x, y)
        _fit(loaded, x, y)
        helpers.assert_same_training_state(loaded, converted)


def test_to_keras_model_rebuilds_custom_layers_and_boost_takes_them_as_is():
    model = _model("nested")
    x, _ = _data()
    expected = model.predict(x, verbose=0)
    thor = keras_thor.models.ThorFunctional(model.inputs, model.outputs)
    plain = keras_thor.to_keras_model(thor)
    layers = _custom_layers(plain)
    assert type(layers["mine"]) is MyDense
    assert type(layers["scale"]) is Scale
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected)
    assert type(plain).__name__ == "Functional"
    assert keras_thor.boost.to_boost_model(model) is model
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)


def test_lambda_keeps_its_function_and_mask():
    def mask(inputs, previous_mask):
        return keras.ops.greater(inputs[..., 0], 0.0)

    # Uses the module global `keras`, which Keras's unsafe reload of a
    # lambda's bytecode would not find.
    function = lambda x: keras.ops.tanh(x)  # noqa: E731
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Lambda(function, mask=mask, name="tanh"),
            keras.layers.Dense(2, name="head"),
        ]
    )
    converted = keras_thor.convert_to_thor_model(model)
    layer = converted.get_layer("tanh")
    assert layer.function is function
    assert layer.mask is mask and layer.supports_masking


class NoConfig(keras.layers.Layer):
    """`get_config` leaves out the required `units`."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def call(self, inputs):
        return inputs[..., : self.units]

    def get_config(self):
        return super().get_config()


class DefaultUnits(keras.layers.Dense):
    """`get_config` leaves out `units`, which has a default."""

    def __init__(self, units=3, **kwargs):
        super().__init__(units, **kwargs)

    def get_config(self):
        config = super().get_config()
        del config["units"]
        return config


def _refusal(model):
    # Conversion takes the model as it is; a rebuild cannot.
    assert keras_thor.convert_to_thor_model(model) is model
    assert keras_thor.boost.to_boost_model(model) is model
    thor = keras_thor.models.ThorSequential([keras.Input((4,)), *model.layers])
    with pytest.raises(ValueError) as info:
        keras_thor.to_keras_model(thor)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_layer_without_its_constructor_arguments_is_refused_in_one_line():
    model = keras.Sequential(
        [keras.Input((4,)), NoConfig(3, name="cut"), keras.layers.Dense(2)]
    )
    message = _refusal(model)
    assert "layer 'cut' (NoConfig)" in message
    assert "units" in message and "`get_config`" in message


def test_layer_rebuilt_with_other_weights_is_refused_in_one_line():
    model = keras.Sequential(
        [keras.Input((4,)), DefaultUnits(5, name="wide"), keras.layers.Dense(2)]
    )
    message = _refusal(model)
    assert "layer 'wide' (DefaultUnits)" in message and "shapes" in message


class ArrayArgument(keras.layers.Layer):
    """Takes an array Keras cannot put in an automatic config."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, inputs):
        return inputs * self.table


def test_layer_without_a_config_is_refused_in_one_line():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            ArrayArgument(np.ones(4, "float32"), name="table"),
            keras.layers.Dense(2),
        ]
    )
    message = _refusal(model)
    assert "layer 'table' (ArrayArgument)" in message
    assert "non-serializable" in message


def test_lambda_output_shape_lambda_is_refused_in_one_line():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Lambda(
                lambda x: x, output_shape=lambda shape: shape, name="same"
            ),
            keras.layers.Dense(2),
        ]
    )
    message = _refusal(model)
    assert "layer 'same' (Lambda)" in message and "output_shape" in message


def test_two_classes_of_one_name_are_refused_in_one_line():
    first = type("Twin", (keras.layers.Dense,), {})
    second = type("Twin", (keras.layers.Dense,), {})
    model = keras.Sequential(
        [keras.Input((4,)), first(3, name="a"), second(2, name="b")]
    )
    message = _refusal(model)
    assert "'Twin'" in message and "register_keras_serializable" in message
