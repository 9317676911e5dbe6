"""`DimReduce`: MindSpore's dimension-reduced line search for Keras models."""

import os

import keras
import numpy as np

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost import boost_callbacks
from keras_thor.src.boost import pca_matrix
from keras_thor.src.utils.validation import check_float
from keras_thor.src.utils.validation import check_int


def _check_open_unit(name, value):
    value = check_float(name, value)
    if not 0.0 < value < 1.0:
        raise ValueError(
            f"Argument `{name}` must be a float in (0, 1). "
            f"Received: {name}={value!r}"
        )
    return value


def _check_path(name, value):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"Argument `{name}` must be a path (a string) or None. "
            f"Received: {name}={value!r}"
        )
    return None if value is None else os.fspath(value)


def _strategy_is_chief(model):
    strategy = model.distribute_strategy
    return bool(getattr(strategy.extended, "should_checkpoint", True))


@keras_thor_export
class DimReduce(boost_callbacks.BoostCallback):
    """Trains in a low-dimensional subspace with BFGS and a line search:
    MindSpore's `mindspore.boost.DimReduce` (DLDR, Li et al., 2022).

    Stage 1 is ordinary training that saves weight snapshots
    (`*.weights.h5`, e.g. `keras.callbacks.ModelCheckpoint(
    save_weights_only=True)`); their top principal directions form the
    orthonormal rows of `P` (k × D). Stage 2 trains with this callback and
    `keras.optimizers.SGD(1.0)`; per step, on one batch:

    ```
    g_k = P g;  B ← BFGS(B, s, y = g_k − g_k_prev)   (not on the first step)
    d_k = −B g_k;  d_n = Pᵀ d_k
    t = first of (1, ρ) with L + σ·t·g_kᵀd_k > L(w + t·d_n), else 0
    t > 0: s ← t·d_k, g_k_prev ← g_k;  t = 0: B, g_k_prev unchanged
    m ← γ·m + (g − Pᵀ g_k)
    w ← w − (α·m − t·d_n)
    ```

    Notation:
        - `g`: the batch gradient (all trainable variables, flattened in
          `model.trainable_variables` order, row-major); `L`: the loss.
        - `B`: the k × k inverse-Hessian estimate (starts as `I`); `s`:
          the last accepted subspace step; `m`: the residual momentum
          outside the subspace (per variable).
        - `ρ`, `σ`, `γ`, `α`: `rho`, `sigma`, `gamma`, `alpha`.

    Pass it to `fit(callbacks=[...])` of a boost model
    (`keras_thor.boost.to_boost_model`) compiled with
    `keras.optimizers.SGD(1.0)`: it wraps the optimizer in a
    `BoostOptimizer` whose state (`B`, `s`, `g_k_prev`, `m`) is saved with
    the model. `AutoBoost` with `dim_reduce` on does the same. The trial
    losses `L(w + t·d_n)` are forward passes on the same batch in training
    mode, with the step's own dropout masks and batch statistics; they
    leave BatchNormalization's moving statistics and the metrics as the
    step left them. The step taken (1, ρ or 0) is logged as
    `dim_reduce_step`.

    Args:
        rho: Float in (0, 1), the backtracking factor.
        gamma: Float in [0, 1), the residual momentum's decay.
        alpha: Float >= 0, the residual momentum's learning rate.
        sigma: Float in (0, 1), the Armijo constant.
        n_components: Integer >= 1, the subspace dimension k.
        pca_mat_path: Path of an `.npy` file holding `P`, or None.
        weight_load_dir: Directory of the stage-1 `*.weights.h5`
            snapshots; `P` is computed from them (more snapshots than
            `n_components`) and written to `pca_mat_temp.npy` there when
            `pca_mat_path` names no existing file.
        timeout: Seconds a worker waits for the chief worker to write `P`.
    """

    def __init__(
        self,
        rho=0.55,
        gamma=0.9,
        alpha=0.001,
        sigma=0.4,
        n_components=32,
        pca_mat_path=None,
        weight_load_dir=None,
        timeout=1800,
    ):
        super().__init__()
        self.rho = _check_open_unit("rho", rho)
        self.gamma = check_float("gamma", gamma, minimum=0.0)
        if self.gamma >= 1.0:
            raise ValueError(
                f"Argument `gamma` must be a float in [0, 1). "
                f"Received: gamma={gamma!r}"
            )
        self.alpha = check_float("alpha", alpha, minimum=0.0)
        self.sigma = _check_open_unit("sigma", sigma)
        self.n_components = check_int("n_components", n_components, 1)
        self.pca_mat_path = _check_path("pca_mat_path", pca_mat_path)
        self.weight_load_dir = _check_path("weight_load_dir", weight_load_dir)
        if self.pca_mat_path is None and self.weight_load_dir is None:
            raise ValueError(
                "DimReduce needs its PCA matrix: pass `pca_mat_path` (an "
                "`.npy` file) or `weight_load_dir` (a directory of "
                "`*.weights.h5` snapshots). Received: pca_mat_path=None, "
                "weight_load_dir=None"
            )
        self.timeout = check_float("timeout", timeout, minimum=0.0)
        if self.timeout == 0.0:
            raise ValueError(
                f"Argument `timeout` must be > 0. Received: timeout={timeout!r}"
            )
        self._prepared_for = None
        self._components = None
        self._variable = None

    @property
    def trial_steps(self):
        """The line search's trial step sizes, in order."""
        return (1.0, self.rho)

    def set_model(self, model):
        super().set_model(model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return
        boost_callbacks.install(
            self, model, "dim_reduce", unwrap_loss_scale=True
        )

    def prepare(self, model):
        """Loads or computes `P` for `model` (see `pca_mat_path`), once
        per model.

        Afterwards `pca_mat_path` names the file `P` came from, so a saved
        model's configuration finds it again.
        """
        if self._prepared_for is not model:
            self._components, self._variable = None, None
            self._prepared_for = model
        if self._components is None:
            components, path = pca_matrix.pca_matrix(
                model,
                self.n_components,
                pca_mat_path=self.pca_mat_path,
                weight_load_dir=self.weight_load_dir,
                timeout=self.timeout,
                is_chief=_strategy_is_chief(model),
            )
            self.pca_mat_path = path
            self._components = np.asarray(components, dtype="float32")
        return self._components

    def components_variable(self, model):
        """`P` as a non-trainable float32 variable of `model`'s strategy
        (one copy per replica), made once per model; not a model weight:
        a saved model finds it again through `pca_mat_path`."""
        if self._prepared_for is not model or self._variable is None:
            components = self.prepare(model)
            with model.distribute_strategy.scope():
                self._variable = keras.Variable(
                    components,
                    dtype="float32",
                    trainable=False,
                    name="dim_reduce_pca_matrix",
                )
            self._components = None  # one copy of P in memory
        return self._variable

    def same_settings(self, other):
        """Whether `other` runs the same algorithm (its `P` file and
        timeout aside: a restored model names the file it computed)."""
        ignored = ("pca_mat_path", "timeout")
        mine, theirs = self.get_config(), other.get_config()
        return all(mine[k] == theirs[k] for k in mine if k not in ignored)

    def get_config(self):
        return {
            "rho": self.rho,
            "gamma": self.gamma,
            "alpha": self.alpha,
            "sigma": self.sigma,
            "n_components": self.n_components,
            "pca_mat_path": self.pca_mat_path,
            "weight_load_dir": self.weight_load_dir,
            "timeout": self.timeout,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"DimReduce({settings})"
