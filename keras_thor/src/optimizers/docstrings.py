"""Docstring text shared by the keras_thor optimizers.

Keras keeps its own copy of this text in a private module; keras_thor keeps
its own so that no private Keras module is imported.
"""

BASE_OPTIMIZER_KEYWORD_ARGS = """name: String. The name to use for momentum
            accumulator weights created by the optimizer.
        clipnorm: Float. If set, the gradient of each weight is individually
            clipped so that its norm is no higher than this value.
        clipvalue: Float. If set, the gradient of each weight is clipped to be
            no higher than this value.
        global_clipnorm: Float. If set, the gradient of all weights is clipped
            so that their global norm is no higher than this value.
        use_ema: Boolean, defaults to `False`. If `True`, exponential moving
            average (EMA) is applied.
        ema_momentum: Float, defaults to 0.99. Only used if `use_ema=True`.
            The momentum to use when computing the EMA of the model's weights.
        ema_overwrite_frequency: Int or None, defaults to None. Only used if
            `use_ema=True`. Every `ema_overwrite_frequency` steps of
            iterations, we overwrite the model variable by its moving average.
        loss_scale_factor: Float or `None`. If a float, the scale factor will
            be multiplied the loss before computing gradients, and the inverse
            of the scale factor will be multiplied by the gradients before
            updating variables. Useful for preventing underflow during
            mixed precision training.
        gradient_accumulation_steps: Int or `None`. If an int, model & optimizer
            variables will not be updated at every step; instead they will be
            updated every `gradient_accumulation_steps` steps, using the
            average value of the gradients since the last update."""


def with_base_keyword_args(cls):
    """Fills `{{base_optimizer_keyword_args}}` in `cls.__doc__`."""
    cls.__doc__ = cls.__doc__.replace(
        "{{base_optimizer_keyword_args}}", BASE_OPTIMIZER_KEYWORD_ARGS
    )
    return cls
