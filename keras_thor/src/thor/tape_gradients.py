"""THOR's forward and backward pass on TensorFlow: one tape.

The layers record their calls' outputs, and the tape differentiates the
loss with respect to the weights and those outputs in one backward pass
(a persistent tape pulls the sampled Fisher's loss a second time).
"""

from keras_thor.src.distribute.train_step import apply_gradients
from keras_thor.src.distribute.train_step import training_call
from keras_thor.src.thor import capture
from keras_thor.src.thor.step_gradients import Forward
from keras_thor.src.thor.step_gradients import wanted_outputs

apply = apply_gradients


def forward_and_gradients(model, x, losses, recorded, plan, refresh, sampled):
    """The step's `Forward`.

    `losses(y_pred)` gives `(loss, scaled_loss, fisher_loss)` (the last
    `None` unless `sampled`); `recorded` are the blocks whose calls are
    recorded; `refresh` asks for every call's output gradient.
    """
    import tensorflow as tf

    variables = model.trainable_weights
    with tf.GradientTape(persistent=sampled) as tape:
        with capture.capture_calls(recorded) as recording:
            y_pred = training_call(model, x)
        loss, scaled_loss, fisher_loss = losses(y_pred)
    calls = recording.calls
    skipped, needed = wanted_outputs(plan, calls, refresh and not sampled)
    plain = [v for v in variables if id(v) not in skipped]
    gradients = tape.gradient(
        scaled_loss, plain + [calls[p].outputs for p in needed]
    )
    output_grads = [None] * len(calls)
    for position, grad in zip(needed, gradients[len(plain) :]):
        output_grads[position] = grad
    plain_grads = iter(gradients[: len(plain)])
    grads = [None if id(v) in skipped else next(plain_grads) for v in variables]
    fisher_grads = output_grads
    if sampled:
        fisher_grads = tape.gradient(
            fisher_loss, [call.outputs for call in calls]
        )
        del tape
    return Forward(y_pred, loss, grads, calls, output_grads, fisher_grads)
