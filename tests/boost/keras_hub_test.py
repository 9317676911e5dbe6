"""Boost on keras-hub's models, changed in place: AutoBoost O1 on a ResNet
classifier, O1 and accumulation on a BERT classifier."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.boost.boost_model import is_boost_model
from keras_thor.src.boost.less_bn import is_bypassed
from keras_thor.src.layers.full_norm import is_full_norm_head
from tests.helpers import assert_same_training_state

# BoostOptimizer's training step is TensorFlow code.
pytestmark = pytest.mark.tf_only
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _hub():
    return pytest.importorskip("keras_hub")


def resnet_classifier():
    """keras-hub's smallest bottleneck ResNet (its first stage needs 64
    filters) with two stages of two blocks, the second strided."""
    hub = _hub()
    keras.utils.set_random_seed(0)
    backbone = hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[2, 2],
        stackwise_num_strides=[1, 2],
        block_type="bottleneck_block",
        use_pre_activation=False,
        image_shape=(16, 16, 3),
    )
    return hub.models.ImageClassifier(
        backbone=backbone, num_classes=4, preprocessor=None
    )


def _images(rows=12):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16, 16, 3)).astype("float32")
    return x, np.arange(rows) % 4


def _o1(model):
    boost = keras_thor.boost.AutoBoost(
        "O1", {"grad_freeze": {"param_groups": 3, "total_steps": 12}}
    )
    model, optimizer, _ = boost.network_auto_process_train(
        model, keras.optimizers.SGD(0.01, momentum=0.9)
    )
    model.compile(optimizer, LOSS)
    return model


def _fit(model, x, y, epochs):
    return model.fit(
        x, y, batch_size=5, epochs=epochs, shuffle=False, verbose=0
    )


def test_auto_boost_o1_on_a_keras_hub_resnet_saves_and_resumes(tmp_path):
    x, y = _images()
    reference = _o1(resnet_classifier())
    _fit(reference, x, y, epochs=3)
    model = resnet_classifier()
    assert _o1(model) is model
    # Both stages' blocks match; the strided ones pad before their 3x3.
    backbone = model.backbone
    bypassed = [
        layer.name
        for layer in backbone.layers
        if isinstance(layer, keras.layers.BatchNormalization)
        and is_bypassed(layer)
    ]
    assert sorted(bypassed) == sorted(
        f"stack{stack}_block{block}_{i}_bn"
        for stack in (0, 1)
        for block in (0, 1)
        for i in (1, 2)
    )
    assert is_full_norm_head(model.output_dense)
    history = _fit(model, x, y, epochs=2)
    assert np.isfinite(history.history["loss"]).all()
    path = tmp_path / "resnet.keras"
    model.save(path)
    loaded = keras_thor.load_model(path)
    assert type(loaded) is type(model) and is_boost_model(loaded)
    assert is_full_norm_head(loaded.output_dense)
    assert_same_training_state(loaded, model, atol=0)
    _fit(loaded, x, y, epochs=1)
    assert_same_training_state(loaded, reference, atol=1e-6)
    # Without keras_thor's loader: the user's model, plain, that predicts
    # as the boosted one up to its head (a Dense again).
    plain = keras.saving.load_model(path, compile=False)
    assert not is_boost_model(plain)
    assert not is_full_norm_head(plain.output_dense)


def test_o1_and_accumulation_on_a_keras_hub_bert_classifier():
    hub = _hub()
    keras.utils.set_random_seed(0)
    backbone = hub.models.BertBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    model = hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=None, dropout=0.0
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 64, (11, 8)),
        "segment_ids": np.zeros((11, 8), "int32"),
        "padding_mask": np.ones((11, 8), bool),
    }
    y = np.arange(11) % 2
    # O1: a FullNorm head, centralization (the embeddings' sparse
    # gradients included) and freezing.
    compiled = _o1(model)
    assert compiled is model and is_full_norm_head(model.output_dense)
    assert not is_full_norm_head(model.backbone.get_layer("pooled_dense"))
    assert any(
        "token_embedding" in path
        for path in model.optimizer.centralized_variables
    )
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert int(model.optimizer.micro_steps) == 6
    model.compile(
        keras_thor.boost.BoostOptimizer(
            keras.optimizers.SGD(0.05), grad_accumulation_step=2
        ),
        LOSS,
    )
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert int(model.optimizer.micro_steps) == 6
    assert int(model.optimizer.inner_optimizer.iterations) == 3
    assert all(np.isfinite(w).all() for w in model.get_weights())
