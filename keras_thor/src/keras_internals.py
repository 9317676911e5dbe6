"""Every private Keras and TensorFlow attribute keras_thor reaches.

Keras 3 offers no public way to do these few things; each function names
the attribute it reads, and `tests/keras_internals_test.py` checks that
every one exists in the installed Keras and TensorFlow (so a release that
renames one fails there first, not inside a training step) and that no
other module of the package reads a private Keras or TensorFlow attribute.
"""

import keras

# Private methods of Keras classes that keras_thor's subclasses override
# (and call through `super()`); the test checks each exists.
OVERRIDES = (
    ("Model", "_maybe_symbolic_build"),
    ("Optimizer", "_backend_update_step"),
    ("Optimizer", "_apply_weight_decay"),
    ("Optimizer", "_clip_gradients"),
)

# (owner, attribute) pairs read below; the test checks each exists.
ATTRIBUTES = (
    ("Layer", "_flatten_layers"),
    ("Layer", "_build_shapes_dict"),
    ("Functional", "_nodes_by_depth"),
    ("Model", "_compute_loss"),
    ("Model", "_loss_tracker"),
    ("Model", "_call_has_training_arg"),
    ("Model", "_autoconvert_optionals"),
    ("Model", "_symbolic_build"),
    ("Optimizer", "_get_variable_index"),
    ("Optimizer", "_var_key"),
    ("Optimizer", "_trainable_variables_indices"),
    ("Optimizer", "_trainable_variables"),
    ("Optimizer", "_variables"),
    ("Optimizer", "_use_weight_decay"),
    ("Optimizer", "_all_reduce_sum_gradients"),
    ("Layer", "_inbound_nodes"),
    ("Layer", "_tracker"),
    ("StrategyExtended", "_in_multi_worker_mode"),
    ("Function", "_list_all_concrete_functions"),
)


def sublayers(layer, recursive=True):
    """The layers inside `layer` (not `layer` itself), depth first.

    `keras.Model.layers` lists a model's direct layers only; layers inside
    layers (MultiHeadAttention's projections, a custom layer's Dense) are
    reached only through `Layer._flatten_layers`.
    """
    return list(layer._flatten_layers(include_self=False, recursive=recursive))


def add_sublayer(layer, name, sublayer):
    """Sets `layer.<name> = sublayer` on a built `layer`, tracked (its
    weights join `layer`'s), although Keras locks a built layer's state
    (`Layer._tracker`)."""
    tracker = layer._tracker
    locked = tracker.locked
    tracker.unlock()
    try:
        setattr(layer, name, sublayer)
    finally:
        if locked:
            tracker.lock()


def is_functional(model):
    """Whether `model` is Sequential or Functional (not subclassed): Keras
    has no public name for its Functional class."""
    return isinstance(model, keras.Sequential) or hasattr(
        model, "_nodes_by_depth"
    )


def built_input_shape(layer):
    """The input shape `layer` was built with (its first argument), or
    `None` when Keras did not record one."""
    shapes = getattr(layer, "_build_shapes_dict", None)
    if not shapes:
        return None
    return next(iter(shapes.values()))


def compute_loss(model, x, y, y_pred, sample_weight):
    """The training loss as Keras's own `train_step` computes it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def loss_tracker(model):
    """The metric behind the `loss` entry of the logs."""
    return model._loss_tracker


def call_has_training_arg(model):
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def autoconvert_optionals(model, function):
    """`function` as Keras wraps its train functions (optional batches)."""
    return model._autoconvert_optionals(function)


def symbolic_build(model, data):
    """Builds `model` (and its optimizer) from the structure of a batch,
    as Keras's `fit` does under a strategy; without one Keras defers it to
    the first trace of the training step."""
    model._symbolic_build(data_batch=data)


def variable_index(optimizer, variable):
    """The position of `variable` in the optimizer's trained variables, or
    `None` when the optimizer does not train it."""
    return optimizer._trainable_variables_indices.get(
        optimizer._var_key(variable)
    )


def trained_variable_index(optimizer, variable):
    """The position of a variable the optimizer trains (raises otherwise)."""
    return optimizer._get_variable_index(variable)


def trained_variables(optimizer):
    """The variables a built optimizer trains, in its order."""
    return optimizer._trainable_variables


def own_optimizer_variables(optimizer):
    """An optimizer's own state variables, without those of an optimizer
    it wraps."""
    return optimizer._variables


def uses_weight_decay(optimizer, variable):
    """Whether Keras's `exclude_from_weight_decay` leaves `variable` in."""
    return optimizer._use_weight_decay(variable)


def skip_gradient_all_reduce(optimizer):
    """Makes a TensorFlow optimizer apply each replica's own gradients:
    its cross-replica sum is Keras's private hook, replaced on this
    instance."""
    optimizer._all_reduce_sum_gradients = list


def inbound_nodes(layer):
    """The nodes where `layer` is called in Functional models."""
    return layer._inbound_nodes


def in_multi_worker_mode(strategy):
    """Whether a strategy really spans several workers."""
    return strategy.extended._in_multi_worker_mode()


def concrete_functions(function):
    """Every concrete function a `tf.function` has traced."""
    return function._list_all_concrete_functions()
