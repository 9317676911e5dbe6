"""DimReduce's pure pieces: BFGS in the PCA subspace and the Armijo test.

Transcribed from MindSpore's `boost/dim_reduce.py` (`DimReduce.construct`,
the newer version) and DLDR's `P_plus_BFGS`; every function takes and
returns tensors and is tested alone against NumPy.
"""

from keras import ops

# MindSpore updates B only when the curvature pair is this positive.
CURVATURE_THRESHOLD = 1e-20


def bfgs_inverse_update(inverse_hessian, step, gradient_change):
    """The BFGS update of the inverse-Hessian estimate `B` (k × k).

    ```
    B ← (I − ρ s yᵀ) B (I − ρ y sᵀ) + ρ s sᵀ,   ρ = 1 / (yᵀ s)
    ```

    kept as it is when `yᵀ s <= 1e-20`.

    Notation:
        - `s`: `step`, the last accepted step in the subspace.
        - `y`: `gradient_change`, `g_k − g_k_prev`.
    """
    s = ops.cast(step, "float32")
    y = ops.cast(gradient_change, "float32")
    ys = ops.sum(y * s)
    curved = ys > CURVATURE_THRESHOLD
    rho = 1.0 / ops.where(curved, ys, 1.0)
    identity = ops.eye(ops.shape(inverse_hessian)[0], dtype="float32")
    left = identity - rho * ops.outer(s, y)
    right = identity - rho * ops.outer(y, s)
    updated = ops.matmul(ops.matmul(left, inverse_hessian), right)
    updated = updated + rho * ops.outer(s, s)
    return ops.where(curved, updated, inverse_hessian)


def armijo_step(loss, trial_losses, trial_steps, sigma, slope):
    """The first trial step `t` with `L + σ·t·slope > L(t)`, else 0.

    A non-finite trial loss is never accepted.

    Notation:
        - `L`: `loss`, the batch loss at the current weights.
        - `L(t)`: `trial_losses[i]`, the same batch's loss at
          `w + t·d_n` for `t = trial_steps[i]`.
        - `slope`: `g_kᵀ d_k` (negative for a descent direction).
    """
    chosen = ops.zeros((), "float32")
    for trial_loss, t in reversed(list(zip(trial_losses, trial_steps))):
        accepted = loss + sigma * t * slope > trial_loss
        accepted = ops.logical_and(accepted, ops.isfinite(trial_loss))
        chosen = ops.where(accepted, float(t), chosen)
    return chosen
