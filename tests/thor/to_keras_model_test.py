"""`to_keras_model`: a THOR-trained model back to plain Keras for serving."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.layers.full_norm import is_full_norm_head
from tests import helpers

pytestmark = pytest.mark.thor_training


@keras.saving.register_keras_serializable("to_keras_test")
class ScaledDense(keras.layers.Dense):
    """A user's Dense subclass (keeps `Dense.call`)."""


def _trained_thor_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 3))
    hidden = keras.layers.Conv1D(4, 3, padding="causal", name="conv")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    inner = keras.Sequential(
        [keras.Input((4,)), ScaledDense(5, activation="relu", name="mine")],
        name="inner",
    )
    outputs = keras.layers.Dense(2, name="head")(inner(hidden))
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    model.compile(
        optimizer=keras_thor.optimizers.THOR(0.05, 0.03, 0.9, frequency=2),
        loss="mse",
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(21, 6, 3)).astype("float32")
    y = rng.normal(size=(21, 2)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return model, x


def test_to_keras_model_keeps_classes_weights_and_predictions():
    model, x = _trained_thor_model()
    plain = keras_thor.to_keras_model(model)
    assert type(plain).__name__ == "Functional"
    assert not isinstance(plain, keras_thor.models.ThorFunctional)
    assert type(plain.get_layer("inner")) is keras.Sequential
    mine = plain.get_layer("inner").get_layer("mine")
    assert type(mine) is ScaledDense
    helpers.assert_all_close(
        helpers.weights_of(plain), helpers.weights_of(model)
    )
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )


def test_legacy_thor_layers_become_keras_layers():
    model = keras_thor.models.ThorSequential(
        [
            keras.Input((4,)),
            keras_thor.layers.ThorDense(3, name="d"),
            keras_thor.layers.ThorLayerNormalization(name="n"),
        ]
    )
    plain = keras_thor.to_keras_model(model)
    assert type(plain) is keras.Sequential
    assert [type(layer) for layer in plain.layers] == [
        keras.layers.Dense,
        keras.layers.LayerNormalization,
    ]


def test_subclassed_thor_model_is_pointed_to_export():
    class Classifier(keras_thor.models.ThorModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Classifier()
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="model.export"):
        keras_thor.to_keras_model(model)


_LOAD_WITHOUT_KERAS_THOR = textwrap.dedent(
    """
    import sys

    sys.modules["keras_thor"] = None  # `import keras_thor` now fails
    import keras
    import numpy as np

    @keras.saving.register_keras_serializable("to_keras_test")
    class ScaledDense(keras.layers.Dense):
        pass

    model = keras.models.load_model(sys.argv[1], compile=False)
    x = np.load(sys.argv[2])
    np.save(sys.argv[3], model.predict(x, verbose=0))
    """
)


def _predict_in_subprocess(tmp_path, script_text, saved, x):
    """Runs `script_text saved x.npy y.npy` in a fresh Python; returns y."""
    np.save(tmp_path / "x.npy", x)
    script = tmp_path / "script.py"
    script.write_text(script_text)
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            saved,
            str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(tmp_path / "y.npy")


def test_saved_plain_model_loads_where_keras_thor_cannot_be_imported(
    tmp_path,
):
    model, x = _trained_thor_model()
    plain = keras_thor.to_keras_model(model)
    path = str(tmp_path / "plain.keras")
    plain.save(path)
    np.testing.assert_allclose(
        _predict_in_subprocess(tmp_path, _LOAD_WITHOUT_KERAS_THOR, path, x),
        model.predict(x, verbose=0),
        atol=1e-6,
    )


_SERVE_WITH_TENSORFLOW_ONLY = textwrap.dedent(
    """
    import sys

    sys.modules["keras_thor"] = None
    sys.modules["keras"] = None  # TensorFlow alone serves a SavedModel
    import numpy as np
    import tensorflow as tf

    served = tf.saved_model.load(sys.argv[1])
    x = np.load(sys.argv[2])
    np.save(sys.argv[3], served.serve(tf.constant(x)).numpy())
    """
)


@pytest.mark.tf_only  # boost trains, and export serves, on TensorFlow
def test_subclassed_thor_model_and_boost_model_serve_through_export(
    tmp_path,
):
    class Classifier(keras_thor.models.ThorModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(5, activation="relu")
            self.logits = keras.layers.Dense(2)

        def call(self, x):
            return self.logits(self.hidden(x))

    rng = np.random.default_rng(1)
    x = rng.normal(size=(9, 3)).astype("float32")
    y = rng.normal(size=(9, 2)).astype("float32")
    subclassed = Classifier()
    subclassed.compile(
        optimizer=keras_thor.optimizers.THOR(0.05, 0.03, 0.9, frequency=2),
        loss="mse",
    )
    subclassed.fit(x, y, batch_size=4, verbose=0)

    base = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)]
    )
    boost = keras_thor.boost.AutoBoost("O1", {})
    boosted, optimizer, callbacks = boost.network_auto_process_train(
        base, keras.optimizers.SGD(0.05, momentum=0.9)
    )
    assert boosted is base and is_full_norm_head(boosted.layers[-1])
    boosted.compile(optimizer=optimizer, loss="mse")
    boosted.fit(x, y, batch_size=4, verbose=0, callbacks=callbacks)

    for name, model in (("subclassed", subclassed), ("boosted", boosted)):
        path = str(tmp_path / name)
        model.export(path, verbose=False)
        np.testing.assert_allclose(
            _predict_in_subprocess(
                tmp_path, _SERVE_WITH_TENSORFLOW_ONLY, path, x
            ),
            model.predict(x, verbose=0),
            atol=1e-5,
        )
