"""Evaluating with ASGD's averaged weights during `fit`."""

import keras


def _averaging_optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if not hasattr(optimizer, "swap_averaged_weights"):
        raise ValueError(
            "`SwapAveragedWeights` needs a model compiled with an averaging "
            "optimizer such as `keras_thor.optimizers.ASGD`. "
            f"Received: optimizer={optimizer!r}"
        )
    return optimizer


class SwapAveragedWeights(keras.callbacks.Callback):
    """Swaps in the optimizer's averaged weights for evaluation.

    The ASGD counterpart of `keras.callbacks.SwapEMAWeights`: validation
    during `fit`, and `evaluate` and `predict` calls that are given this
    callback, see the averaged weights `ax`; training resumes from the
    trained weights afterwards, and after `fit` the model holds the trained
    weights (a plain `model.evaluate()` measures those). The swap is an
    exact exchange (no arithmetic on the values).

    With `swap_on_epoch=True` the averaged weights are also in the model
    between `on_epoch_end` and the next `on_epoch_begin`, so callbacks placed
    after this one (e.g. `keras.callbacks.ModelCheckpoint`,
    `BackupAndRestore`) see them. The optimizer records which weights the
    model holds, so a state saved that way resumes exactly: training always
    starts from the trained weights. At the end of training the trained
    weights are put back; use `ASGD(finalize_with_average=True)` to end
    with the averages instead. `evaluate` and `predict` restore whatever
    the model held before them.

    Args:
        swap_on_epoch: Boolean. Whether to keep the averaged weights in the
            model between epochs as well. Defaults to `False`.

    Example:

    ```python
    model.compile(optimizer=keras_thor.optimizers.ASGD(t0=100), loss="mse")
    model.fit(x, y, validation_data=(x_val, y_val),
              callbacks=[keras_thor.callbacks.SwapAveragedWeights()])
    model.evaluate(x_test, y_test,
                   callbacks=[keras_thor.callbacks.SwapAveragedWeights()])
    ```
    """

    def __init__(self, swap_on_epoch=False):
        super().__init__()
        if not isinstance(swap_on_epoch, bool):
            raise TypeError(
                "Argument `swap_on_epoch` must be a boolean. "
                f"Received: swap_on_epoch={swap_on_epoch!r}"
            )
        self.swap_on_epoch = swap_on_epoch
        self._previous = False

    def _optimizer(self):
        optimizer = _averaging_optimizer(self.model)
        return optimizer if optimizer.built else None

    def _set_averaged(self, averaged):
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.set_averaged_weights_in_model(averaged)

    def _remember_and_set_averaged(self):
        optimizer = self._optimizer()
        self._previous = optimizer and optimizer.averaged_weights_in_model
        self._set_averaged(True)

    def on_train_begin(self, logs=None):
        # Also puts back the trained weights of a state that was saved
        # with the averages in the model (BackupAndRestore, ModelCheckpoint).
        self._set_averaged(False)

    def on_epoch_begin(self, epoch, logs=None):
        self._set_averaged(False)

    def on_epoch_end(self, epoch, logs=None):
        if self.swap_on_epoch:
            self._set_averaged(True)

    def on_train_end(self, logs=None):
        self._set_averaged(False)

    def on_test_begin(self, logs=None):
        self._remember_and_set_averaged()

    def on_test_end(self, logs=None):
        self._set_averaged(bool(self._previous))

    def on_predict_begin(self, logs=None):
        self._remember_and_set_averaged()

    def on_predict_end(self, logs=None):
        self._set_averaged(bool(self._previous))
