"""THOR on the models users train, converted in place: keras-hub's
backbones and tasks, subclassed models, saving and resuming them."""

import keras
import numpy as np
import pytest

import keras_thor
from tests.helpers import assert_same_training_state
from tests.helpers import resumed_after_interruption

thor_trains = pytest.mark.thor_training
VOCABULARY, SEQUENCE = 50, 8


def _factor_weight(model):
    """The weight of THOR's first block's factor average."""
    thor = model.optimizer
    block = next(iter(thor.curvature_blocks.values()))
    return thor.state_for(block.kernel).factor_weight


def _curvature_refreshed(model):
    """Whether THOR's first block holds factors gathered in training."""
    return float(_factor_weight(model)) > 0


def _hub():
    return pytest.importorskip("keras_hub")


def keras_hub_families():
    """Tiny configs of keras-hub's families, and the share of parameters
    THOR preconditions in each (docs/thor.md, "keras-hub")."""
    text = dict(vocabulary_size=100, num_layers=1, hidden_dim=16)
    decoder = dict(text, num_query_heads=2, num_key_value_heads=1)
    return {
        "bert": ("BertBackbone", dict(text, num_heads=2, intermediate_dim=32,
                                      max_sequence_length=16), 0.9),
        "distil_bert": ("DistilBertBackbone", dict(
            text, num_heads=2, intermediate_dim=32, max_sequence_length=16
        ), 0.9),
        "gpt2": ("GPT2Backbone", dict(text, num_heads=2, intermediate_dim=32,
                                      max_sequence_length=16), 0.9),
        "llama": ("LlamaBackbone", dict(decoder, intermediate_dim=32), 0.9),
        "gemma": ("GemmaBackbone", dict(decoder, intermediate_dim=32,
                                        head_dim=8), 0.9),
        "mistral": ("MistralBackbone", dict(decoder, intermediate_dim=32),
                    0.9),
        "mixtral": ("MixtralBackbone", dict(decoder, intermediate_dim=32,
                                            num_experts=2, top_k=1), 0.9),
        "t5": ("T5Backbone", dict(text, num_heads=2, intermediate_dim=32,
                                  key_value_dim=8), 0.9),
        "vit": ("ViTBackbone", dict(image_shape=(16, 16, 3), patch_size=8,
                                    num_layers=1, num_heads=2, hidden_dim=16,
                                    mlp_dim=32), 0.9),
        "resnet": ("ResNetBackbone", dict(
            input_conv_filters=[64], input_conv_kernel_sizes=[3],
            stackwise_num_filters=[64], stackwise_num_blocks=[1],
            stackwise_num_strides=[1], block_type="basic_block",
            use_pre_activation=False, image_shape=(16, 16, 3),
        ), 0.9),
    }  # fmt: skip


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the coverage does not depend on the backend: run once",
)
@pytest.mark.parametrize("family", sorted(keras_hub_families()))
def test_keras_hub_backbones_convert_in_place(family):
    hub = _hub()
    class_name, config, share = keras_hub_families()[family]
    backbone = getattr(hub.models, class_name)(**config)
    variables = [id(v) for v in backbone.weights]
    coverage = keras_thor.curvature_coverage(backbone)
    assert coverage.share >= share, str(coverage)
    # Every layer class left first-order is named, with its reason.
    for row in coverage.first_order:
        assert "no curvature rule for its class" not in row.rule, row
    converted = keras_thor.convert_to_thor_model(backbone)
    assert converted is backbone
    assert type(converted) is getattr(hub.models, class_name)
    assert [id(v) for v in converted.weights] == variables


def causal_lm(**thor_args):
    """A tiny keras-hub `GPT2CausalLM` (dropout 0), converted and compiled
    with `THOR.recommended(frequency=2, **thor_args)` (under the caller's
    strategy scope, if any)."""
    hub = _hub()
    keras.utils.set_random_seed(0)
    backbone = hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=SEQUENCE,
        dropout=0.0,
    )
    model = hub.models.GPT2CausalLM(backbone, preprocessor=None)
    keras_thor.convert_to_thor_model(model)
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(
            frequency=2, **thor_args
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def token_data(rows=13):
    """Token windows and their next tokens (13 rows in batches of 4: a
    partial last batch of 1)."""
    tokens = np.random.default_rng(0).integers(0, VOCABULARY, (rows, SEQUENCE))
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)}
    return x, np.roll(tokens, -1, axis=1)


def _fit(model, epochs, callbacks=(), initial_epoch=0):
    x, y = token_data()
    return model.fit(
        x,
        y,
        batch_size=4,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def _check_generate(model):
    tokens = token_data()[0]["token_ids"][:2]
    prompt = np.arange(SEQUENCE) < 3
    generated = model.generate(
        {"token_ids": tokens, "padding_mask": np.stack([prompt, prompt])},
        stop_token_ids=None,
    )
    assert np.asarray(generated["padding_mask"]).all()
    np.testing.assert_array_equal(generated["token_ids"][:, :3], tokens[:, :3])


@thor_trains
def test_keras_hubcausal_lm_trains_saves_and_resumes_with_thor(tmp_path):
    hub = _hub()
    model = causal_lm()
    history = _fit(model, 2)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert int(model.optimizer.iterations) == 8
    assert _curvature_refreshed(model)
    # The Task's own behaviour stays.
    if keras.backend.backend() == "tensorflow":
        # keras-hub's sampler fails under JAX's x64 mode, which this suite
        # turns on for its float64 references.
        _check_generate(model)
    assert model.get_config()["backbone"]["class_name"] == "GPT2Backbone"

    path = str(tmp_path / "lm.keras")
    model.save(path)
    _fit(model, 3, initial_epoch=2)
    resumed = keras_thor.load_model(path)
    assert type(resumed) is hub.models.GPT2CausalLM
    assert isinstance(resumed.optimizer, keras_thor.optimizers.THOR)
    assert int(resumed.optimizer.iterations) == 8
    _fit(resumed, 3, initial_epoch=2)
    assert_same_training_state(resumed, model, atol=1e-5, rtol=1e-5)
    # The Task's own `compile` defaults stay (keras-hub's "auto": Adam).
    resumed.compile(sampler="greedy")
    assert isinstance(resumed.optimizer, keras.optimizers.Adam)


# On JAX, THOR's BackupAndRestore resumes in tests/saved_state_test.py;
# here three keras-hub models compile THOR's steps (2.5 min on JAX).
@pytest.mark.tf_only
@thor_trains
def test_keras_hubcausal_lm_resumes_from_backup_and_restore(tmp_path):
    def fit(model, epochs, callbacks):
        _fit(model, epochs, callbacks)

    uninterrupted = causal_lm()
    _fit(uninterrupted, 3)
    resumed = resumed_after_interruption(
        causal_lm, fit, str(tmp_path / "backup"), epochs=3, interrupt_at=2
    )
    assert_same_training_state(resumed, uninterrupted, atol=1e-5, rtol=1e-5)


class UsersClassifier(keras.Model):
    """A user's subclassed model, on `keras.Model`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        return self.logits(self.hidden(x))


def _classification_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(21, 5)).astype("float32")
    return x, rng.integers(0, 3, 21)


@thor_trains
def test_subclassed_keras_model_trains_with_thor_in_place():
    keras.utils.set_random_seed(0)
    model = UsersClassifier()
    model(np.zeros((1, 5), "float32"))
    assert keras_thor.convert_to_thor_model(model) is model
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _classification_data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 6
    assert _curvature_refreshed(model)

    # Undone and converted again, THOR keeps gathering into its blocks.
    weight = float(_factor_weight(model))
    keras_thor.convert_to_thor_model(keras_thor.to_keras_model(model))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert float(_factor_weight(model)) > weight

    # Undone: the same object, its class's methods, not THOR's step.
    assert keras_thor.to_keras_model(model) is model
    assert "fit" not in vars(model) and "call" not in vars(model.hidden)
    with pytest.raises(ValueError, match="Convert the model first"):
        model.compile(
            optimizer=keras_thor.optimizers.THOR.recommended(), loss="mse"
        )
        model.fit(x, np.zeros((21, 3)), verbose=0)


@thor_trains
def test_clone_and_frozen_models_get_errors_that_say_why():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    keras_thor.convert_to_thor_model(model)
    clone = keras.models.clone_model(model)
    clone.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(), loss="mse"
    )
    x = np.zeros((4, 5), "float32")
    with pytest.raises(ValueError, match="clone_model"):
        clone.fit(x, np.zeros((4, 3)), verbose=0)

    model.layers[0].trainable = False
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(), loss="mse"
    )
    with pytest.raises(ValueError, match=r"frozen.*\['dense"):
        model.fit(x, np.zeros((4, 3)), verbose=0)

    frozen = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    frozen.layers[0].trainable = False
    with pytest.raises(ValueError, match="frozen"):
        keras_thor.convert_to_thor_model(frozen)


def test_conversion_refuses_what_it_cannot_convert():
    with pytest.raises(TypeError, match="must be a `keras.Model`"):
        keras_thor.convert_to_thor_model(keras.layers.Dense(3))
    with pytest.raises(ValueError, match="must be built"):
        keras_thor.convert_to_thor_model(UsersClassifier())
    with pytest.raises(ValueError, match=r"`momentum` must be <= 1"):
        keras_thor.optimizers.THOR(0.1, 0.1, 1.5)
    with pytest.raises(ValueError, match=r"`momentum` must be < 1 with"):
        keras_thor.optimizers.THOR(0.1, 0.1, 1.0, first_order="adam")


@thor_trains
def test_a_class_with_its_own_train_step_is_refused_by_thor_only():
    class OwnStep(UsersClassifier):
        def train_step(self, *args, **kwargs):
            return super().train_step(*args, **kwargs)

    model = OwnStep()
    model(np.zeros((1, 5), "float32"))
    keras_thor.convert_to_thor_model(model)
    x, y = _classification_data()
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(), loss="mse"
    )
    with pytest.raises(ValueError, match=r"OwnStep.train_step"):
        model.fit(x, np.zeros((21, 3)), verbose=0)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((21, 3)), verbose=0)


@thor_trains
def test_a_loss_scale_optimizer_built_before_conversion_builds_thor():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras_thor.optimizers.THOR.recommended()
        ),
        loss="mse",
    )
    model.optimizer.build(model.trainable_variables)  # as Keras's loading
    assert not model.optimizer.inner_optimizer.built
    keras_thor.convert_to_thor_model(model)
    x, _ = _classification_data()
    model.fit(x, np.zeros((21, 3)), batch_size=4, verbose=0)
    assert model.optimizer.inner_optimizer.built
    assert int(model.optimizer.inner_optimizer.iterations) == 6
