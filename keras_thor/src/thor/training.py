"""THOR's training step, one code path for TensorFlow and JAX.

MindSpore compiles two graphs for THOR: one that captures the curvature
statistics and refreshes the inverses, one that only preconditions with the
stored inverses. Here they are variants of one step (`tf.function`s on
TensorFlow, `jax.jit`s on JAX), chosen in Python before each step from the
optimizer's step counter, so a step that does not refresh never computes a
statistic, and no collective sits inside a `tf.cond` (which breaks under
tf.distribute). With `THOR(statistics_frequency=...)` a third one gathers
statistics without inverting.

Only the forward and backward pass and the final update are backend code
(`tape_gradients`, `probe_gradients`); on JAX the step runs inside a
`keras.StatelessScope` (`jax_train_function`), so its variable writes
become the step's new state.
"""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.distribute import replicas
from keras_thor.src.distribute.train_step import examples as batch_examples
from keras_thor.src.distribute.train_step import keras_train_step
from keras_thor.src.thor import capture
from keras_thor.src.thor import probe_gradients
from keras_thor.src.thor import tape_gradients
from keras_thor.src.thor.directions import Guard
from keras_thor.src.thor.directions import step_directions
from keras_thor.src.thor.loss_terms import terms_per_example
from keras_thor.src.thor.optimizer import THOR
from keras_thor.src.thor.sampled_fisher import fisher_loss_kind
from keras_thor.src.thor.sampled_fisher import sampled_loss
from keras_thor.src.thor.sampled_fisher import sampled_targets
from keras_thor.src.thor.state_writes import StateWrites


def thor_optimizer_of(optimizer):
    """The `THOR` inside `optimizer` (unwrapping a `LossScaleOptimizer`)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, THOR) else None


def _sampled_fisher_loss(model, thor, y_pred):
    """The loss at targets drawn from the model's predictive distribution,
    scaled as the training loss is (`sampled_fisher`)."""
    kind, from_logits = fisher_loss_kind(model.loss)
    # JAX keys take 32-bit words (and JAX has no int64 without x64).
    dtype = "int32" if keras.backend.backend() == "jax" else "int64"
    step = ops.cast(thor.iterations, dtype) + ops.cast(
        thor.estimator.steps_burned_in(), dtype
    )
    seed = ops.stack([step, ops.cast(replicas.replica_id(), dtype)])
    targets = sampled_targets(kind, from_logits, y_pred, seed)
    loss = sampled_loss(kind, from_logits, targets, y_pred)
    return model.optimizer.scale_loss(loss / replicas.replica_count())


def _guard(thor, loss_scale, invert):
    """The step-size guard's `Guard` (`kl_clip`), else `None`; with
    `kl_clip_steps="refresh"` a step that does not `invert` holds the last
    `ν`, and one that does keeps it if its sum is not finite."""
    if thor.kl_clip is None:
        return None
    held = fallback = None
    if thor.kl_clip_steps == "refresh":
        last = thor.estimator.held_guard_scale()
        held, fallback = (None, last) if invert else (last, None)
    return Guard(
        kl_clip=thor.kl_clip,
        mode=thor.kl_clip_mode,
        learning_rate=ops.cast(thor.learning_rate, "float32"),
        momentum=thor.momentum,
        velocity_of=thor.velocity_of,
        damping=thor.current_damping(),
        batch_size=float(thor.batch_size),
        loss_scale=loss_scale,
        held_scale=held,
        fallback_scale=fallback,
    )


def _backend():
    """The module of the backend's forward and backward pass and update."""
    if keras.backend.backend() == "jax":
        return probe_gradients
    return tape_gradients


def _loss_function(model, thor, x, y, sample_weight, sampled):
    """`y_pred -> (loss, scaled_loss, fisher_loss)`: the training loss as
    Keras's `train_step` computes it, scaled for the optimizer, and with
    `sampled` the sampled Fisher's loss (else `None`)."""

    def losses(y_pred):
        loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight)
        fisher_loss = None
        if sampled:
            fisher_loss = _sampled_fisher_loss(model, thor, y_pred)
        return loss, model.optimizer.scale_loss(loss), fisher_loss

    return losses


def train_step(model, data, statistics, invert, update=True):
    """One training step; it gathers curvature statistics if `statistics`
    and then refreshes the inverses if `invert`; it updates the weights if
    `update` (else it is a burn-in step, counted by the estimator).

    As Keras's `train_step`, plus: layers with curvature blocks record
    their calls, the loss is differentiated with respect to their outputs
    too (statistics steps, and Dense layers preconditioned in the factored
    order; with `fisher="sampled"`, a second loss at sampled targets gives
    the statistics), the estimator makes the step's new curvature state
    from them, which `THOR.write_state` writes; the direction stage
    (`directions`) forms the directions the step owns from the new
    inverses, and `THOR.write_state` writes what it adds (the guard scale;
    a burn-in step's count) before the update. The logs carry
    `THOR.training_logs()`. Under a strategy, a `LossScaleOptimizer` sees
    an overflow on any replica (Keras's looks at replica 0's gradients).
    """
    thor = thor_optimizer_of(model.optimizer)
    if thor is None:
        return keras_train_step(model, data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = model.trainable_weights
    if not thor.built:
        # The layers' curvature rules need the layers built: this builds
        # the model, then the optimizer (a `LossScaleOptimizer` too).
        keras_internals.symbolic_build(model, data)
        variables = model.trainable_weights
    plan = thor.step_plan
    estimator = thor.estimator
    recorded = estimator.recorded_blocks()
    if not statistics:
        recorded = {i: recorded[i] for i in plan.factored_kernels}
    sampled = statistics and plan.fisher == "sampled"
    backend = _backend()
    writes = StateWrites()
    with capture.thor_training_step():
        forward = backend.forward_and_gradients(
            model,
            x,
            _loss_function(model, thor, x, y, sample_weight, sampled),
            recorded.values(),
            plan,
            statistics,
            sampled,
        )
        keras_internals.loss_tracker(model).update_state(
            forward.loss * replicas.replica_count(),
            sample_weight=batch_examples(x),
        )
        loss_scale = ops.cast(model.optimizer.scale_loss(1.0), "float32")
        if statistics:
            terms = terms_per_example(forward.y_pred)
            examples = batch_examples(x) * replicas.replica_count()
            sample_scale = ops.cast(examples * terms, "float32") / loss_scale
            estimator.refresh(
                estimator.gather(
                    forward.calls, forward.fisher_grads, sample_scale, terms
                ),
                thor.current_damping(),
                invert,
                writes,
            )
            thor.write_state(writes)
        grads = forward.grads
        if update:
            # After the refresh: the directions read the new inverses.
            grads, scale = step_directions(
                plan,
                estimator.blocks,
                estimator.values_after(writes),
                variables,
                grads,
                forward.calls,
                forward.output_grads,
                _guard(thor, loss_scale, invert),
            )
            if scale is not None:
                estimator.record_guard_scale(scale, writes)
        else:
            estimator.record_burn_in(writes)
        thor.write_state(writes)
        if update:
            backend.apply(model.optimizer, grads, variables)
    logs = model.compute_metrics(
        x, y, forward.y_pred, sample_weight=sample_weight
    )
    return {**logs, **thor.training_logs()}
