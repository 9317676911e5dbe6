"""Recording THOR-aware layer calls during a curvature-refresh step.

THOR needs, for every THOR-aware layer call of a refresh step, the layer's
inputs and its outputs (so that the training step can differentiate the
loss with respect to them). Layers record into the active capture, if any;
outside a capture they run as their Keras parents do. The capture is
per thread, which keeps replicas apart under `tf.distribute`.
"""

import contextlib
import threading
import weakref

_ACTIVE = threading.local()
_ROLE = "_keras_thor_role"
LAYER_NORM_ROLE = "layer_norm"


class LayerCall:
    """One recorded call: the layer, its inputs and its (pre-activation)
    outputs."""

    def __init__(self, layer, inputs, outputs):
        self.layer = layer
        self.inputs = inputs
        self.outputs = outputs


@contextlib.contextmanager
def capture_layer_calls():
    """Context manager yielding the list the calls inside it append to."""
    previous = getattr(_ACTIVE, "calls", None)
    calls = []
    _ACTIVE.calls = calls
    try:
        yield calls
    finally:
        _ACTIVE.calls = previous


def capturing():
    """Whether a THOR-aware layer called now should record itself."""
    return getattr(_ACTIVE, "calls", None) is not None


def record(layer, inputs, outputs):
    """Adds a call to the active capture (there must be one)."""
    _ACTIVE.calls.append(LayerCall(layer, inputs, outputs))


def mark_kernel(variable, layer):
    """Marks `variable` as the Kronecker-preconditioned kernel of `layer`."""
    setattr(variable, _ROLE, weakref.ref(layer))


def mark_layer_norm(variable):
    """Marks `variable` for THOR's diagonal LayerNorm rule."""
    setattr(variable, _ROLE, LAYER_NORM_ROLE)


def thor_layer_of(variable):
    """The THOR-aware layer whose kernel `variable` is, or `None`."""
    role = getattr(variable, _ROLE, None)
    if isinstance(role, weakref.ref):
        return role()
    return None


def is_layer_norm_variable(variable):
    """Whether `variable` is a gamma or beta of a THOR-aware LayerNorm."""
    return getattr(variable, _ROLE, None) == LAYER_NORM_ROLE
