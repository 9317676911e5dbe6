"""Recording the calls of layers that have curvature blocks.

THOR needs, for the calls of some layers in a training step, the layer's
inputs and its pre-activation outputs (so that the training step can
differentiate the loss with respect to them). Layers stay the Keras layers
the user wrote: `hook_layer` gives a layer instance a `call` of its own
that runs its class's `call` unchanged, and records while a capture is
active in this thread for one of the layer's blocks. The capture is per
thread, which keeps replicas apart under `tf.distribute`.

A layer passes each recorded output through `capture.tap(outputs)` before
using it further. On TensorFlow a tap is the identity (the tape
differentiates with respect to any tensor). On JAX, where only a
function's arguments can be differentiated, a capture made with `probes`
adds the next probe, a zero argument of the output's shape, so that the
gradient at the probe is the gradient at the output (kfac-jax's trick);
a capture made with `probes=DISCOVER` only lists the tapped outputs, whose
shapes the probes take.
"""

import contextlib
import threading
import types

_ACTIVE = threading.local()
_CAPTURE_CALL = "_keras_thor_capture_call"


# `capture_calls(..., probes=DISCOVER)`: list the tapped outputs only.
DISCOVER = "discover"


class LayerCall:
    """One recorded call: the block, its inputs and (pre-activation)
    outputs, and `tap`, the index of the outputs among the capture's
    tapped tensors (their probe's index)."""

    def __init__(self, block, inputs, outputs, tap=None):
        self.block = block
        self.inputs = inputs
        self.outputs = outputs
        self.tap = tap


class _Capture:
    def __init__(self, blocks, probes):
        self.blocks = set(map(id, blocks))
        self.probes = probes
        self.calls = []
        self.tapped = []

    def wants(self, block):
        return id(block) in self.blocks

    def tap(self, outputs):
        """`outputs`, plus the next probe where the capture has probes."""
        if self.probes is not None and self.probes is not DISCOVER:
            outputs = outputs + self.probes[len(self.tapped)]
        self.tapped.append(outputs)
        return outputs

    def record(self, block, inputs, outputs):
        if self.wants(block):
            tap = next(
                (k for k, t in enumerate(self.tapped) if t is outputs), None
            )
            self.calls.append(LayerCall(block, inputs, outputs, tap))


@contextlib.contextmanager
def capture_calls(blocks, probes=None):
    """Context manager yielding the `_Capture` of `blocks`' layers called
    inside it (in this thread): `.calls`, the `LayerCall`s; `.tapped`, the
    tapped outputs. `probes`: see the module's docstring."""
    previous = getattr(_ACTIVE, "capture", None)
    capture = _Capture(blocks, probes)
    _ACTIVE.capture = capture
    try:
        yield capture
    finally:
        _ACTIVE.capture = previous


_STEPS = {"running": 0}
_STEPS_LOCK = threading.Lock()


@contextlib.contextmanager
def thor_training_step():
    """Marks THOR's training step as running (see `in_thor_training_step`).

    Counted for the whole process, not per thread: under tf.distribute a
    `LossScaleOptimizer` applies the updates from threads of its own.
    """
    with _STEPS_LOCK:
        _STEPS["running"] += 1
    try:
        yield
    finally:
        with _STEPS_LOCK:
            _STEPS["running"] -= 1


def in_thor_training_step():
    """Whether THOR's training step, the only one that gives THOR its
    curvature, is running (being traced or run eagerly)."""
    return _STEPS["running"] > 0


def _hooked_call(layer, *args, **kwargs):
    capture = getattr(_ACTIVE, "capture", None)
    capture_call = getattr(layer, _CAPTURE_CALL)
    if capture is None:
        return type(layer).call(layer, *args, **kwargs)
    return capture_call(layer, args, kwargs, capture)


def hook_layer(layer, capture_call):
    """Makes `layer` run `capture_call(layer, args, kwargs, capture)` in
    place of its class's `call` while a capture is active.

    `capture_call` runs the layer's computation and calls
    `capture.record(block, inputs, outputs)` for the blocks it computes.
    Hooking a layer twice replaces the first hook.
    """
    object.__setattr__(layer, _CAPTURE_CALL, capture_call)
    object.__setattr__(layer, "call", types.MethodType(_hooked_call, layer))


def is_hooked(layer):
    """Whether `hook_layer` hooked `layer` (and it was not unhooked)."""
    return _CAPTURE_CALL in layer.__dict__


def unhook_layer(layer):
    """Undoes `hook_layer`: `layer` runs its class's `call` again."""
    layer.__dict__.pop(_CAPTURE_CALL, None)
    layer.__dict__.pop("call", None)


def call_inputs(args, kwargs):
    """The `inputs` argument of a Keras layer `call`."""
    return args[0] if args else kwargs["inputs"]


def run_recording_pre_activation(layer, args, kwargs, capture, blocks):
    """The layer's own `call`, recording for each of `blocks` (a kernel's
    and maybe its bias's) the inputs and the value its `activation` is
    applied to (the pre-activation output).

    Works for the Keras layers whose `call` ends in
    `self.activation(outputs)` (Dense, EinsumDense, convolutions). Replicas
    run one at a time between collectives, and a layer's `call` holds none,
    so swapping the activation for the call is thread safe.
    """
    if not any(capture.wants(block) for block in blocks):
        return type(layer).call(layer, *args, **kwargs)
    activation = layer.activation
    seen = []

    def recording(outputs):
        outputs = capture.tap(outputs)
        seen.append(outputs)
        return activation(outputs)

    object.__setattr__(layer, "activation", recording)
    try:
        outputs = type(layer).call(layer, *args, **kwargs)
    finally:
        object.__setattr__(layer, "activation", activation)
    if len(seen) == 1:
        for block in blocks:
            capture.record(block, call_inputs(args, kwargs), seen[0])
    return outputs
