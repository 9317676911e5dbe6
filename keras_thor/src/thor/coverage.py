"""How much of a model THOR preconditions: `keras_thor.curvature_coverage`."""

import collections
import math

from keras_thor.src.thor.blocks import BiasKronecker
from keras_thor.src.thor.curvature import SUPPORTED
from keras_thor.src.thor.curvature import layer_curvature
from keras_thor.src.thor.curvature import model_layers
from keras_thor.src.thor.curvature import own_trainable_variables

LayerCoverage = collections.namedtuple(
    "LayerCoverage",
    ["name", "class_name", "parameters", "curvature_parameters", "rule"],
)


def _size(variable):
    return math.prod(variable.shape)


class CurvatureCoverage:
    """Per-layer table of what THOR preconditions in a model.

    Attributes:
        layers: One `LayerCoverage(name, class_name, parameters,
            curvature_parameters, rule)` per layer with trainable
            variables of its own; `rule` names the blocks (e.g.
            `DenseKronecker`), or says why the layer stays first-order.
        parameters: The model's trainable parameters.
        curvature_parameters: Those THOR preconditions (Kronecker blocks
            and the normalization layers' diagonal rule; biases (unless
            `THOR(precondition_biases=...)`) and everything else take the
            plain gradient).
    """

    def __init__(self, layers):
        self.layers = layers
        self.parameters = sum(row.parameters for row in layers)
        self.curvature_parameters = sum(
            row.curvature_parameters for row in layers
        )

    @property
    def share(self):
        """The preconditioned share of the trainable parameters."""
        return self.curvature_parameters / max(self.parameters, 1)

    @property
    def first_order(self):
        """The layers none of whose variables THOR preconditions."""
        return [row for row in self.layers if row.curvature_parameters == 0]

    def summary(self):
        """One line: layers with curvature and the preconditioned share."""
        covered = len(self.layers) - len(self.first_order)
        return (
            f"THOR preconditions {covered} of {len(self.layers)} layers with "
            f"trainable weights: {self.curvature_parameters:,} of "
            f"{self.parameters:,} trainable parameters ({self.share:.1%})."
        )

    def __str__(self):
        header = ("layer", "class", "parameters", "curvature", "rule")
        rows = [header] + [
            (
                row.name,
                row.class_name,
                f"{row.parameters:,}",
                f"{row.curvature_parameters:,}",
                row.rule,
            )
            for row in self.layers
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(r, widths))
            + "  "
            + r[4]
            for r in rows
        ]
        return "\n".join(lines + [self.summary()])


def _rule(curvature):
    if curvature.reason is not None:
        return f"first-order: {curvature.reason}"
    names = sorted(
        {
            type(p).__name__
            for p in curvature.preconditioners.values()
            if not isinstance(p, BiasKronecker)
        }
    )
    return ", ".join(names)


def curvature_coverage(model):
    """What THOR preconditions in `model`, layer by layer.

    Works on any Keras model (converted or not): the table says what
    `THOR` would do with each layer's own trainable variables once the
    model is converted with `keras_thor.convert_to_thor_model`.

    Args:
        model: A built `keras.Model`.

    Returns:
        A `CurvatureCoverage`: `print` it for the table; `.share` is the
        preconditioned share of the trainable parameters, `.first_order`
        the layers left to THOR's first-order rule (`first_order`).
    """
    rows = []
    for layer in model_layers(model):
        variables = own_trainable_variables(layer)
        if not variables:
            continue
        curvature = layer_curvature(layer)
        rows.append(
            LayerCoverage(
                layer.name,
                type(layer).__name__,
                sum(_size(v) for v in variables),
                sum(
                    _size(v)
                    for v in variables
                    if v.path in curvature.preconditioners
                    and not isinstance(
                        curvature.preconditioners[v.path], BiasKronecker
                    )
                ),
                _rule(curvature),
            )
        )
    return CurvatureCoverage(rows)


def supported_layer_names():
    """The Keras classes THOR has curvature rules for, by name."""
    return sorted(cls.__name__ for cls in SUPPORTED)
