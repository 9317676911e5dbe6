"""THOR's rules for keras-hub's own layers: Mixtral's batched experts."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.thor import capture
from keras_thor.src.thor.blocks import ExpertsKronecker
from keras_thor.src.thor.curvature import layer_curvature

EXPERTS, HIDDEN, INTERMEDIATE, TOKENS = 3, 4, 6, 5


def _experts():
    hub = pytest.importorskip("keras_hub")
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts

    del hub
    keras.utils.set_random_seed(0)
    layer = MixtralMoeExperts(EXPERTS, HIDDEN, INTERMEDIATE)
    layer.build((TOKENS, HIDDEN))
    return layer


def _np(value):
    return keras.ops.convert_to_numpy(value).astype("float64")


def test_expert_statistics_are_each_experts_dense_factors():
    layer = _experts()
    kernel = layer.weights[0]
    block = ExpertsKronecker(layer, kernel)
    assert (block.groups, block.a_dim, block.g_dim) == (3, 4, 6)
    rng = np.random.default_rng(0)
    shared = rng.normal(size=(TOKENS, HIDDEN)).astype("float32")
    own = rng.normal(size=(EXPERTS, TOKENS, HIDDEN)).astype("float32")
    grads = rng.normal(size=(EXPERTS, TOKENS, INTERMEDIATE)).astype("float32")
    a, g, rows, scale = block.statistics(shared, grads)
    for e in range(EXPERTS):
        np.testing.assert_allclose(_np(a)[e], shared.T @ shared, rtol=1e-5)
        np.testing.assert_allclose(_np(g)[e], grads[e].T @ grads[e], rtol=1e-5)
    assert float(rows) == TOKENS and scale == 1.0
    a, _, _, _ = block.statistics(own, grads)
    for e in range(EXPERTS):
        np.testing.assert_allclose(_np(a)[e], own[e].T @ own[e], rtol=1e-5)
    # The kernel reads as one (in, out) matrix per expert, and back.
    gradient = rng.normal(size=tuple(kernel.shape)).astype("float32")
    matrices = _np(block.to_matrices(gradient))
    np.testing.assert_array_equal(matrices[1], gradient[1])
    np.testing.assert_array_equal(_np(block.from_matrices(matrices)), gradient)


def test_the_recorded_call_is_the_layers_and_records_each_kernel():
    layer = _experts()
    curvature = layer_curvature(layer)
    blocks = list(curvature.preconditioners.values())
    assert len(blocks) == 3 and curvature.reason is None
    x = np.random.default_rng(1).normal(size=(TOKENS, HIDDEN))
    x = x.astype("float32")
    expected = _np(type(layer).call(layer, x))
    with capture.capture_calls(blocks) as recorded:
        outputs = curvature.capture_call(layer, (x,), {}, recorded)
    np.testing.assert_allclose(_np(outputs), expected, rtol=1e-5, atol=1e-6)
    calls = {call.block.kernel.name: call for call in recorded.calls}
    assert sorted(calls) == sorted(b.kernel.name for b in blocks)
    down = calls["expert_feedforward_output_dense"]
    assert tuple(down.inputs.shape) == (EXPERTS, TOKENS, INTERMEDIATE)
    assert down.outputs is outputs
    gate = calls["expert_feedforward_gate_dense"]
    np.testing.assert_allclose(
        _np(gate.outputs),
        np.einsum("th,ehm->etm", x, _np(gate.block.kernel)),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.thor_training
def test_a_mixtral_causal_lm_trains_with_the_expert_blocks():
    hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = hub.models.MixtralBackbone(
        vocabulary_size=50,
        num_layers=1,
        hidden_dim=8,
        num_query_heads=2,
        num_key_value_heads=1,
        intermediate_dim=16,
        num_experts=2,
        top_k=1,
    )
    model = hub.models.MixtralCausalLM(backbone, preprocessor=None)
    keras_thor.convert_to_thor_model(model)
    model.compile(
        keras_thor.optimizers.THOR.recommended(frequency=2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, 50, (6, 4)),
        "padding_mask": np.ones((6, 4), bool),
    }
    history = model.fit(
        x, rng.integers(1, 50, (6, 4)), batch_size=3, epochs=2, verbose=0
    )
    assert np.all(np.isfinite(history.history["loss"]))
    thor = model.optimizer
    experts = [
        block
        for block in thor.curvature_blocks.values()
        if isinstance(block, ExpertsKronecker)
    ]
    assert len(experts) == 3
    for block in experts:
        assert float(thor.state_for(block.kernel).factor_weight) > 0
