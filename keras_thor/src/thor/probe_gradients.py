"""THOR's forward and backward pass on JAX: zero probes at the outputs.

JAX differentiates a function with respect to its arguments only, so the
gradient at a layer's output is taken as kfac-jax takes it: each recorded
output gets a zero probe added (`capture.tap`), and one `jax.vjp` of the
loss with respect to the weights and the probes gives the weights'
gradients and, at each probe, the gradient at that output. The forward
pass runs once; the sampled Fisher's loss is pulled back through the same
`vjp` a second time. The probes' shapes come from tracing the forward
pass once more (`jax.eval_shape`), which costs compile time only.

The forward pass runs in a `keras.StatelessScope` of its own, holding the
differentiated weights and the current value of every other variable; the
variables it updates (BatchNormalization statistics, seed generators,
loss trackers) are written back in the step's scope afterwards.
"""

import keras

from keras_thor.src.distribute.train_step import training_call
from keras_thor.src.thor import capture
from keras_thor.src.thor.step_gradients import Forward
from keras_thor.src.thor.step_gradients import wanted_outputs


def _other_variables(model, trainable):
    """Every variable of the model, its optimizer and its metrics that is
    not in `trainable`, once each."""
    seen = {id(v) for v in trainable}
    others = []
    optimizer_variables = model.optimizer.variables if model.optimizer else []
    for variable in (
        list(model.non_trainable_variables)
        + list(optimizer_variables)
        + list(model.metrics_variables)
    ):
        if id(variable) not in seen:
            seen.add(id(variable))
            others.append(variable)
    return others


def forward_and_gradients(model, x, losses, recorded, plan, refresh, sampled):
    """The step's `Forward` (see `tape_gradients.forward_and_gradients`)."""
    import jax
    import jax.numpy as jnp

    variables = model.trainable_weights
    others = _other_variables(model, variables)
    other_values = [v.value for v in others]
    recorded = list(recorded)
    traced = {}

    def forward(values, probes):
        mapping = list(zip(variables, values)) + list(zip(others, other_values))
        with keras.StatelessScope(
            state_mapping=mapping, collect_losses=True
        ) as scope:
            with capture.capture_calls(recorded, probes) as recording:
                y_pred = training_call(model, x)
            if probes is capture.DISCOVER:
                return recording.tapped
            loss, scaled_loss, fisher_loss = losses(y_pred)
        traced["calls"] = recording.calls
        updates = [scope.get_current_value(v) for v in others]
        if fisher_loss is None:
            fisher_loss = jnp.zeros((), scaled_loss.dtype)
        inputs = [call.inputs for call in recording.calls]
        return (scaled_loss, fisher_loss), (y_pred, loss, inputs, updates)

    values = [v.value for v in variables]
    tapped = jax.eval_shape(
        lambda values: forward(values, capture.DISCOVER), values
    )
    probes = [jnp.zeros(t.shape, t.dtype) for t in tapped]
    losses_out, pull, aux = jax.vjp(forward, values, probes, has_aux=True)
    y_pred, loss, inputs, updates = aux
    for variable, value in zip(others, updates):
        variable.assign(value)
    scaled_loss, fisher_loss = losses_out
    zero, one = jnp.zeros_like(scaled_loss), jnp.ones_like(scaled_loss)
    grads, probe_grads = pull((one, jnp.zeros_like(fisher_loss)))
    calls = [
        capture.LayerCall(call.block, call_inputs, None, call.tap)
        for call, call_inputs in zip(traced["calls"], inputs)
    ]
    skipped, needed = wanted_outputs(plan, calls, refresh and not sampled)
    output_grads = [None] * len(calls)
    for position in needed:
        output_grads[position] = probe_grads[calls[position].tap]
    grads = [None if id(v) in skipped else g for v, g in zip(variables, grads)]
    fisher_grads = output_grads
    if sampled:
        _, fisher_probe_grads = pull((zero, jnp.ones_like(fisher_loss)))
        fisher_grads = [fisher_probe_grads[call.tap] for call in calls]
    return Forward(y_pred, loss, grads, calls, output_grads, fisher_grads)


def apply(optimizer, grads, variables):
    """`optimizer`'s update of `variables` as its `stateless_apply` (a
    `LossScaleOptimizer` chooses its branch with `lax.cond`), written to
    the step's scope."""
    optimizer_variables = optimizer.variables
    new_values, new_optimizer_values = optimizer.stateless_apply(
        [v.value for v in optimizer_variables],
        grads,
        [v.value for v in variables],
    )
    for variable, value in zip(variables, new_values):
        variable.assign(value)
    for variable, value in zip(optimizer_variables, new_optimizer_values):
        variable.assign(value)
