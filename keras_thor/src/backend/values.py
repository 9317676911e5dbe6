"""Reading a variable's value into NumPy without NumPy 2's warning."""

import keras
from keras import ops


def numpy_value(variable):
    """A copy of `variable`'s value as a NumPy array.

    `ops.convert_to_numpy` goes through `__array__` without NumPy 2's
    `copy` keyword on TensorFlow variables and tensors, JAX variables and
    torch tensors, which NumPy deprecates; each reads itself instead.
    """
    if isinstance(variable, keras.Variable):
        variable = variable.value
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return ops.convert_to_tensor(variable).numpy().copy()
    if backend == "torch":
        variable = variable.detach().cpu()
        if str(variable.dtype) == "torch.bfloat16":
            variable = variable.float()
        return variable.numpy().copy()
    return ops.convert_to_numpy(variable).copy()
