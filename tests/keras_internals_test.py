"""Private Keras/TensorFlow attributes: only in keras_internals, and real."""

import ast
import pathlib

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src import keras_internals

pytestmark = pytest.mark.tf_only

PACKAGE = pathlib.Path(keras_thor.__file__).parent


def _objects():
    """Keras and TensorFlow objects of the kinds keras_thor works with."""
    import tensorflow as tf

    inputs = keras.Input((3,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    functional.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    functional.fit(np.zeros((2, 3)), np.zeros((2, 2)), verbose=0)
    strategy = tf.distribute.get_strategy()
    return {
        "Layer": functional.layers[1],
        "Model": functional,
        "Functional": functional,
        "Sequential": keras.Sequential([keras.Input((3,))]),
        "Optimizer": functional.optimizer,
        "LossScaleOptimizer": keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD()
        ),
        "Variable": functional.weights[0],
        "StrategyExtended": strategy.extended,
        "MirroredStrategy": tf.distribute.MirroredStrategy,
        "ReplicaContext": tf.distribute.ReplicaContext,
        "Function": tf.function(lambda: 1),
        "Tensor": tf.constant(1.0),
        "TFVariable": tf.Variable(1.0),
        "Callback": keras.callbacks.History(),
        "MultiHeadAttention": keras.layers.MultiHeadAttention,
        "BatchNormalization": keras.layers.BatchNormalization,
    }


@pytest.fixture(scope="module")
def objects():
    return _objects()


def test_every_private_attribute_keras_thor_reads_exists(objects):
    for owner, name in keras_internals.ATTRIBUTES + keras_internals.OVERRIDES:
        assert hasattr(objects[owner], name), f"{owner}.{name}"


def _private_names(objects):
    names = set()
    for value in objects.values():
        names |= {
            n for n in dir(value) if n.startswith("_") and not n[1] == "_"
        }
    return names


def _own_attributes(class_node):
    """The `self._x` names a keras_thor class assigns itself."""
    owned = set()
    for node in ast.walk(class_node):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        while any(isinstance(t, ast.Tuple) for t in targets):
            targets = [
                e
                for t in targets
                for e in (t.elts if isinstance(t, ast.Tuple) else [t])
            ]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                owned.add(target.attr)
    return owned


def _uses(path, names):
    """`(line, what)` for each private Keras/TF name `path` reads or
    overrides, its own attributes excepted."""
    tree = ast.parse(path.read_text())
    owned = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            owned |= _own_attributes(node)
    overrides = {name for _, name in keras_internals.OVERRIDES}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            if node.name not in overrides:
                yield node.lineno, f"def {node.name}"
        if (
            isinstance(node, ast.Attribute)
            and node.attr in names
            and node.attr not in owned
        ):
            is_super = (
                isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "super"
            )
            if not (is_super and node.attr in overrides):
                yield node.lineno, ast.unparse(node)


def test_private_keras_attributes_are_reached_only_through_keras_internals(
    objects,
):
    names = _private_names(objects)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "keras_internals.py":
            continue
        found += [
            f"{path.relative_to(PACKAGE)}:{line}: {what}"
            for line, what in _uses(path, names)
        ]
    assert not found, "\n".join(found)
