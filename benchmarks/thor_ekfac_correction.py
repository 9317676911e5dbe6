"""How much EKFAC's eigenvalue correction would change THOR's step.

EKFAC (George et al., 2018) keeps K-FAC's eigenbasis and replaces the
eigenvalues `s_A s_Gᵀ` of `A ⊗ G` by the second moments of the per-example
gradients projected on it, `S*`. Before building it, this measures on
benchmark 1's Dense-only tasks how far `S*` is from `s_A s_Gᵀ`, and how much
the step changes, at the preset's damping and split:

```
A = Q_A diag(s_A) Q_Aᵀ,  G = Q_G diag(s_G) Q_Gᵀ,  ĝ = Q_Aᵀ g Q_G
S*    = mean_n (Q_Aᵀ x_n)² (Q_Gᵀ d_n)²ᵀ
K-FAC: d = Q_A (ĝ ⊘ (s_A s_Gᵀ + π√λ·s_G + √λ/π·s_A + λ)) Q_Gᵀ   (π split)
EKFAC: the same with S* for s_A s_Gᵀ, or exactly damped: ĝ ⊘ (S* + λ)
```

Notation:
    - `x_n`: a layer's input row with the bias's 1 appended (joint bias
      rows, as the preset); `d_n`: the per-example gradient of the loss
      with respect to the layer's pre-activation (the empirical Fisher, as
      the preset); `A`, `G`, `S*` over the same rows: `--batches` batches
      of 128 drawn from the training set (seed 1), about the preset's
      averaging window; `g`: the gradient of one batch.

The model is the task's (seed 0) after `--epochs` epochs of
`THOR.recommended()`. Prints, per layer, the ratio `S*/(s_A s_G)` over the
entries with the largest 10% of `s_A s_G` (median and 10%/90% quantiles),
and each EKFAC step's cosine with K-FAC's and its norm ratio:

    python benchmarks/thor_ekfac_correction.py --tasks mnist_mlp \\
        autoencoder --epochs 0 1
"""

import argparse

import harness
import keras
import numpy as np
import tensorflow as tf

import keras_thor
from keras_thor.optimizers import THOR


def _dense_layers(model, task):
    layers = [layer for layer in model.layers if layer.weights]
    if not all(isinstance(layer, keras.layers.Dense) for layer in layers):
        raise ValueError(
            "This measurement runs a Sequential model of Dense layers. "
            f"Received: task={task.name!r}"
        )
    return layers


def _rows(task, layers, x, y, batches, rng, batch=128):
    """Per layer: the input rows `[x, 1]` and the per-example
    pre-activation gradients, over `batches` random batches."""
    inputs = [[] for _ in layers]
    grads = [[] for _ in layers]
    for _ in range(batches):
        index = rng.choice(len(x), batch, replace=False)
        with tf.GradientTape() as tape:
            hidden = tf.constant(x[index])
            pre_activations = []
            for i, layer in enumerate(layers):
                ones = np.ones((batch, 1), "float32")
                inputs[i].append(np.concatenate([hidden.numpy(), ones], 1))
                pre = tf.matmul(hidden, layer.kernel) + layer.bias
                tape.watch(pre)
                pre_activations.append(pre)
                hidden = layer.activation(pre)
            loss = tf.reduce_mean(task.loss(y[index], hidden))
        for i, grad in enumerate(tape.gradient(loss, pre_activations)):
            grads[i].append(grad.numpy() * batch)  # per example
    return [
        (
            np.concatenate(a).astype("float64"),
            np.concatenate(d).astype("float64"),
        )
        for a, d in zip(inputs, grads)
    ]


def _cosine_and_ratio(step, reference):
    norm, reference_norm = np.linalg.norm(step), np.linalg.norm(reference)
    return (step * reference).sum() / (
        norm * reference_norm
    ), norm / reference_norm


def correction(inputs, grads, damping, batch=128):
    """The measurement for one layer's rows (see the module docstring)."""
    rows = len(inputs)
    a, g = inputs.T @ inputs / rows, grads.T @ grads / rows
    s_a, q_a = np.linalg.eigh(a)
    s_g, q_g = np.linalg.eigh(g)
    s_a, s_g = np.maximum(s_a, 0.0), np.maximum(s_g, 0.0)
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
    corrected = ((inputs @ q_a) ** 2).T @ (grads @ q_g) ** 2 / rows
    kfac = np.outer(s_a, s_g)
    root = np.sqrt(damping)
    factored = pi * root * s_g[None, :] + root / pi * s_a[:, None] + damping
    gradient = inputs[-batch:].T @ grads[-batch:] / batch**2
    rotated = q_a.T @ gradient @ q_g

    def step(eigenvalues):
        return q_a @ (rotated / eigenvalues) @ q_g.T

    reference = step(kfac + factored)
    top = kfac > np.quantile(kfac, 0.9)
    ratio = corrected[top] / kfac[top]
    return {
        "shape": a.shape[0:1] + g.shape[0:1],
        "ratio": np.quantile(ratio, [0.1, 0.5, 0.9]),
        "factored": _cosine_and_ratio(step(corrected + factored), reference),
        "exact": _cosine_and_ratio(step(corrected + damping), reference),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", nargs="+", default=["mnist_mlp", "autoencoder"]
    )
    parser.add_argument("--epochs", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--damping", type=float, default=1e-3)
    args = parser.parse_args()
    print(
        "| task | epochs | layer | S*/(s_A s_G): q10, median, q90 "
        "| EKFAC, π split: cos, norm | EKFAC, exact damping: cos, norm |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.tasks:
        task = harness.TASKS[name]
        x, y, _ = task.load()
        for epochs in args.epochs:
            keras.utils.set_random_seed(0)
            model = keras_thor.convert_to_thor_model(task.build())
            model.compile(
                optimizer=THOR.recommended(batch_size=task.batch),
                loss=task.loss,
            )
            if epochs:
                model.fit(x, y, batch_size=task.batch, epochs=epochs, verbose=0)
            layers = _dense_layers(model, task)
            rng = np.random.default_rng(1)
            for layer, (inputs, grads) in zip(
                layers, _rows(task, layers, x, y, args.batches, rng)
            ):
                found = correction(inputs, grads, args.damping)
                q10, median, q90 = found["ratio"]
                print(
                    f"| ({task.letter}) | {epochs} | {layer.name} "
                    f"{found['shape'][0]}×{found['shape'][1]} "
                    f"| {q10:.2f}, {median:.2f}, {q90:.2f} "
                    "| {:.3f}, {:.3f} | {:.3f}, {:.2f} |".format(
                        *found["factored"], *found["exact"]
                    )
                )


if __name__ == "__main__":
    main()
