"""Base-optimizer options that Keras gets wrong under tf.distribute."""


def _replicas(optimizer):
    # Keras's TensorFlow optimizer keeps the strategy it was created under.
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return getattr(strategy, "num_replicas_in_sync", 1)


def check_base_options_under_strategy(optimizer):
    """Raises for base options that break with several replicas.

    In Keras 3.15, `clipnorm`, `clipvalue` and `global_clipnorm` clip each
    replica's gradient before the all-reduce (so results differ from one
    device), and `gradient_accumulation_steps` and `ema_overwrite_frequency`
    fail with a `merge_call` error. Refusing them is better than a silently
    different result.
    """
    if _replicas(optimizer) <= 1:
        return
    options = {
        "clipnorm": optimizer.clipnorm,
        "clipvalue": optimizer.clipvalue,
        "global_clipnorm": optimizer.global_clipnorm,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
        "ema_overwrite_frequency": optimizer.ema_overwrite_frequency,
    }
    used = {name: value for name, value in options.items() if value}
    if used:
        received = ", ".join(
            f"{name}={value!r}" for name, value in used.items()
        )
        raise ValueError(
            f"`{type(optimizer).__name__}` cannot use {', '.join(used)} under "
            f"a tf.distribute strategy with {_replicas(optimizer)} replicas: "
            "Keras clips each replica's gradient before the all-reduce and "
            "cannot accumulate gradients or overwrite with the EMA there. "
            f"Remove them, or train on one device. Received: {received}"
        )
