"""keras-hub's layers that THOR knows by package and class name.

keras-hub is not a dependency, so its classes are named, not imported:
its families' RMS normalizations (LayerNormalization's diagonal rule), its
`PositionEmbedding` (an Embedding over the positions) and Mixtral's
batched experts (a Kronecker block per expert) have rules, recorded by the
calls below; the layers in `KNOWN_FIRST_ORDER` stay first-order, for the
reason given.
"""

import keras
from keras import ops

from keras_thor.src.thor import capture

# keras-hub's families' own RMS normalizations (scale only; they share no
# base class): LayerNormalization's diagonal rule on their scale, as on
# `keras.layers.RMSNormalization`'s.
RMS_NORMALIZATIONS = {
    ("keras_hub", "LlamaLayerNorm"),
    ("keras_hub", "MistralLayerNormalization"),
    ("keras_hub", "MixtralLayerNormalization"),
    ("keras_hub", "RMSNormalization"),
    ("keras_hub", "T5LayerNorm"),
    ("keras_hub", "QwenLayerNorm"),
    ("keras_hub", "QwenMoeLayerNorm"),
    ("keras_hub", "Qwen3LayerNorm"),
    ("keras_hub", "Qwen3MoeLayerNorm"),
    ("keras_hub", "Phi3LayerNorm"),
    ("keras_hub", "Gemma3nRMSNorm"),
    ("keras_hub", "GptOssLayerNormalization"),
}
# Why keras-hub's other layers with weights of their own stay first-order.
KNOWN_FIRST_ORDER = {
    ("keras_hub", "ViTPatchingAndEmbedding"): (
        "its class token (its patch convolution and position table are "
        "sublayers, with curvature); no curvature rule yet"
    ),
    ("keras_hub", "T5MultiHeadAttention"): (
        "its relative attention bias table; no curvature rule yet (its "
        "projections are Dense layers, with curvature)"
    ),
}
# `MixtralMoeExperts`' kernels, by variable name: `(E, in, out)` each.
_EXPERT_KERNELS = (
    "expert_feedforward_gate_dense",
    "expert_feedforward_intermediate_dense",
    "expert_feedforward_output_dense",
)


def package_and_name(layer):
    """`(top-level package, class name)` of `layer`'s class."""
    cls = type(layer)
    return cls.__module__.split(".")[0], cls.__name__


def is_rms_normalization(layer):
    """Whether `layer` is Keras's or a keras-hub family's RMS norm."""
    return (
        type(layer) is keras.layers.RMSNormalization
        or package_and_name(layer) in RMS_NORMALIZATIONS
    )


def position_call(layer, args, kwargs, capture_, block):
    """keras-hub's `PositionEmbedding`: an Embedding whose ids are the
    positions (`positions`, else `start_index` onwards along the sequence
    axis, the same for every example)."""
    outputs = type(layer).call(layer, *args, **kwargs)
    if not capture_.wants(block):
        return outputs
    positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
    if positions is None:
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        shape = ops.shape(capture.call_inputs(args, kwargs))
        positions = ops.arange(shape[-2], dtype="int32") + start
    # One id per output row (keras-hub broadcasts unbatched positions).
    positions = ops.broadcast_to(
        ops.cast(positions, "int32"), ops.shape(outputs)[:-1]
    )
    outputs = capture_.tap(outputs)
    capture_.record(block, positions, outputs)
    return outputs


def experts_kernels(layer):
    """`{name: variable}` of a `MixtralMoeExperts`' three kernels."""
    by_name = {variable.name: variable for variable in layer.weights}
    missing = [name for name in _EXPERT_KERNELS if name not in by_name]
    if missing:
        raise ValueError(
            f"`{type(layer).__name__}` has no weights named {missing}: "
            "keras_thor knows keras-hub 0.32's MixtralMoeExperts. "
            f"Received: weights {sorted(by_name)}"
        )
    return {name: by_name[name] for name in _EXPERT_KERNELS}


def experts_call(layer, args, kwargs, capture_, blocks):
    """keras-hub 0.32's `MixtralMoeExperts.call`, recording each kernel's
    inputs and outputs (`blocks`: `ExpertsKronecker` by kernel name):

    ```
    gate = silu(x @ W_gate[e]),  up = x @ W_up[e]      (per expert e)
    out[e] = (up · gate) @ W_down[e]
    ```
    """
    if not any(capture_.wants(block) for block in blocks.values()):
        return type(layer).call(layer, *args, **kwargs)
    gate_block, up_block, down_block = (blocks[n] for n in _EXPERT_KERNELS)
    x = args[0] if args else kwargs["hidden_states"]
    gate = capture_.tap(ops.einsum("th,ehm->etm", x, gate_block.kernel))
    capture_.record(gate_block, x, gate)
    gate = ops.cast(layer.activation(ops.cast(gate, "float32")), gate.dtype)
    up = capture_.tap(ops.einsum("th,ehm->etm", x, up_block.kernel))
    capture_.record(up_block, x, up)
    hidden = up * gate
    out = capture_.tap(ops.einsum("eti,eih->eth", hidden, down_block.kernel))
    capture_.record(down_block, hidden, out)
    return out
