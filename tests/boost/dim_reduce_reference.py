"""A NumPy re-implementation of MindSpore's DimReduce step (newer version,
research/boost.md §6.2), for the tests: the model only supplies the loss
and its gradient at given weights (eager, float64 bookkeeping)."""

import numpy as np
import tensorflow as tf

from keras_thor.src.backend.values import numpy_value


def flat(variables):
    return np.concatenate(
        [numpy_value(v).reshape(-1) for v in variables]
    ).astype("float64")


def set_flat(model, values):
    offset = 0
    for v in model.trainable_variables:
        size = int(np.prod(v.shape))
        v.assign(values[offset : offset + size].reshape(v.shape))
        offset += size


def loss_and_gradient(model, x, y):
    with tf.GradientTape() as tape:
        prediction = model(x, training=True)
        loss = model.compute_loss(x, y, prediction)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), flat(grads)


def bfgs(inverse_hessian, s, y):
    ys = float(y @ s)
    if ys <= 1e-20:
        return inverse_hessian
    rho = 1.0 / ys
    identity = np.eye(len(s))
    left = identity - rho * np.outer(s, y)
    right = identity - rho * np.outer(y, s)
    return left @ inverse_hessian @ right + rho * np.outer(s, s)


class DimReduceReference:
    """DimReduce's state and step, as documented."""

    def __init__(self, components, rho, gamma, alpha, sigma):
        self.components = np.asarray(components, "float64")
        self.rho, self.gamma, self.alpha, self.sigma = rho, gamma, alpha, sigma
        k, dimension = self.components.shape
        self.inverse_hessian = np.eye(k)
        self.subspace_step = np.zeros(k)
        self.previous = np.zeros(k)
        self.momentum = np.zeros(dimension)
        self.steps = 0
        self.taken = []

    def step(self, model, x, y):
        P = self.components
        w = flat(model.trainable_variables)
        loss, g = loss_and_gradient(model, x, y)
        gk = P @ g
        inverse_hessian = self.inverse_hessian
        if self.steps > 0:
            inverse_hessian = bfgs(
                inverse_hessian, self.subspace_step, gk - self.previous
            )
        dk = -inverse_hessian @ gk
        dn = P.T @ dk
        slope = float(gk @ dk)
        taken = 0.0
        for t in (1.0, self.rho):
            set_flat(model, w + t * dn)
            trial, _ = loss_and_gradient(model, x, y)
            if loss + self.sigma * t * slope > trial:
                taken = t
                break
        if taken > 0:
            self.inverse_hessian = inverse_hessian
            self.previous = gk
            self.subspace_step = taken * dk
        self.momentum = self.gamma * self.momentum + (g - P.T @ gk)
        set_flat(model, w - (self.alpha * self.momentum - taken * dn))
        self.steps += 1
        self.taken.append(taken)
        return taken
