"""How many terms of the compiled loss each example contributes.

THOR's `G` factors are second moments of per-sample output gradients: the
gradient of each term the compiled loss averages. Keras's losses reduce the
last axis of a prediction (classes, features) and average over every other
axis, so a prediction `(N, L, V)` (a language model's next-token logits)
makes `N·L` terms, not `N`: its per-sample gradients are the gradient of
the mean loss times `N·L`. Scaling by `N` alone leaves `G` `L²` times too
small, so the damping swamps it and the step is a scaled gradient step
(a character GPT with context 64 stalled that way).

Notation:
    - `N`: the examples in the batch; `L`: the positions of one example's
      prediction, the product of its axes between the batch and the last.
"""

import keras
from keras import ops


def terms_per_example(y_pred):
    """`L`: the loss terms of one example of the prediction `y_pred`.

    1 for a prediction of rank 2 or less, and for a model with several
    outputs (their losses are averaged separately and summed; the examples
    are the only axis they share).
    """
    outputs = keras.tree.flatten(y_pred)
    if len(outputs) != 1 or len(outputs[0].shape) < 3:
        return 1
    positions = 1
    for size in ops.shape(outputs[0])[1:-1]:
        positions = positions * size
    return positions
