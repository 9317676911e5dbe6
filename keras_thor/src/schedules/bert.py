"""MindSpore's BERT THOR schedules: Keras's `PolynomialDecay`.

MindSpore's `_get_poly_lr` (no warm-up) is
`v_i = (v_max - v_min) * (1 - i / T) ** p + v_min`, which is exactly
`keras.optimizers.schedules.PolynomialDecay(v_max, T, v_min, p)`; these
helpers only carry MindSpore's defaults.
"""

import keras

from keras_thor.src.utils import validation


def bert_thor_learning_rate(
    initial_learning_rate=0.0034,
    end_learning_rate=3.244e-05,
    power=1.0,
    decay_steps=30000,
):
    """MindSpore's `get_bert_thor_lr`, with its defaults.

    Its BERT-large recipe uses `(0.006464, 1e-6, 2.0, 30000)`.
    """
    return keras.optimizers.schedules.PolynomialDecay(
        initial_learning_rate, decay_steps, end_learning_rate, power
    )


def bert_thor_damping(
    initial_damping=5e-2, end_damping=1e-6, power=1.0, decay_steps=30000
):
    """MindSpore's `get_bert_thor_damping`, with its defaults.

    Its BERT-large recipe uses `(0.007035, 1e-6, 4.0, 30000)`. Both ends
    must be > 0: THOR divides by `√λ` where a factor is flat.
    """
    for name, value in (
        ("initial_damping", initial_damping),
        ("end_damping", end_damping),
    ):
        if validation.check_float(name, value, minimum=0.0) == 0:
            raise ValueError(
                f"Argument `{name}` must be > 0. Received: {name}={value!r}"
            )
    return keras.optimizers.schedules.PolynomialDecay(
        initial_damping, decay_steps, end_damping, power
    )
