"""`GroupLossScaleManager`: MindSpore's group ("enhanced AMP") loss scales."""

import math
import numbers

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.layers.loss_scale_group import LossScaleGroup
from keras_thor.src.layers.loss_scale_group import check_marker_indices
from keras_thor.src.utils.validation import check_int


def _check_scale(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"Argument `{name}` must be a positive float. "
            f"Received: {name}={value!r} (of type {type(value).__name__})"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"Argument `{name}` must be a finite float > 0. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def _check_init_loss_scale(value):
    """A positive float, or a non-empty list of them (one per group)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(
                "Argument `init_loss_scale` must be a positive float or a "
                "non-empty list of them. Received: init_loss_scale=[]"
            )
        return [
            _check_scale(f"init_loss_scale[{i}]", v)
            for i, v in enumerate(value)
        ]
    return _check_scale("init_loss_scale", value)


def _group_index(groups):
    """`{id(variable): group}` of valid, disjoint `groups`."""
    message = (
        "Argument `loss_scale_groups` must be a list of lists of "
        "`keras.Variable`s."
    )
    if not isinstance(groups, (list, tuple)):
        raise TypeError(
            f"{message} Received: loss_scale_groups={groups!r} "
            f"(of type {type(groups).__name__})"
        )
    index = {}
    for j, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise TypeError(
                f"{message} Received: loss_scale_groups[{j}]={group!r} "
                f"(of type {type(group).__name__})"
            )
        for i, variable in enumerate(group):
            if not isinstance(variable, keras.Variable):
                raise TypeError(
                    f"{message} Received: loss_scale_groups[{j}][{i}]="
                    f"{variable!r} (of type {type(variable).__name__})"
                )
            if id(variable) in index:
                raise ValueError(
                    "Loss scale groups must not overlap. Received: variable "
                    f"`{variable.path}` in groups {index[id(variable)]} "
                    f"and {j}"
                )
            index[id(variable)] = j
    return index


def _model_markers(model):
    """The `LossScaleGroup` layers of `model` and its nested models."""
    markers, seen, stack = [], set(), [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if isinstance(layer, LossScaleGroup):
            markers.append(layer)
        stack.extend(getattr(layer, "layers", ()))
    return markers


@keras_thor_export
class GroupLossScaleManager:
    """One loss scale per group of variables: MindSpore's
    `mindspore.boost.GroupLossScaleManager` ("enhanced AMP").

    Call it inside a Functional model at the segment boundaries, as in
    MindSpore: `x = manager(x, 0, 1)` at the inputs, `manager(x, g, g+1)`
    between segments, `manager(x, n, n+1)` on the outputs. Each call
    places the `keras_thor.layers.LossScaleGroup` marker of that pair (the
    same layer for the same pair): the identity forward, the gradient
    times `s[first] / s[second]` backward.

    ```
    s[0] = s[n+1] = 1,   s[j+1] = init_loss_scale (or init_loss_scale[j])
    segment g (between markers (g−1, g) and (g, g+1)) runs its backward
    pass at scale s[g]; the loss is not scaled, the input gradient is
    at s[0] = 1
    ```

    Notation:
        - `n`: the number of groups, `loss_scale_number`.
        - `s`: the float32 scales `s[0..n+1]` (`scales`), held by the
          markers; group `j` (0-based, `j < n`) is scaled by `s[j+1]`.

    The markers start at `s = 1` (no scaling) until
    `set_loss_scale_status(n, init)`, which MindSpore's training cell calls
    with `len(loss_scale_groups)` and `init_loss_scale`; markers made
    later start at the scales it set. A loaded model's markers keep their
    scales as weights (see `LossScaleGroup`); `from_model` gives them a
    manager again. `keras_thor.callbacks.GroupLossScale` trains with it
    (per-group overflow checks and scale updates).

    Args:
        init_loss_scale: Positive float, or a list of one per group.
        loss_scale_groups: A list of lists of `keras.Variable`s, disjoint;
            group `j` is scaled by `s[j+1]`. May be None (or `[]`) and set
            later as the attribute, as in MindSpore's example.
        name: Prefix of the markers' names (`{name}_{first}_{second}`);
            by default a unique `group_loss_scale...`.
    """

    def __init__(self, init_loss_scale, loss_scale_groups=None, name=None):
        self.init_loss_scale = _check_init_loss_scale(init_loss_scale)
        if name is None:
            uid = keras.backend.get_uid("group_loss_scale")
            name = "group_loss_scale" + (f"_{uid - 1}" if uid > 1 else "")
        if not isinstance(name, str) or not name:
            raise ValueError(
                "Argument `name` must be a non-empty string. "
                f"Received: name={name!r}"
            )
        self.name = name
        self.loss_scale_number = None
        self._status_scales = None
        self._markers = {}
        self.loss_scale_groups = loss_scale_groups

    @property
    def loss_scale_groups(self):
        """The groups of variables (lists), or None."""
        return self._loss_scale_groups

    @loss_scale_groups.setter
    def loss_scale_groups(self, groups):
        if groups is None:
            self._loss_scale_groups, self._group_of = None, {}
            return
        index = _group_index(groups)
        self._check_group_count(self.loss_scale_number, groups)
        self._loss_scale_groups = [list(group) for group in groups]
        self._group_of = index

    def _check_group_count(self, number, groups):
        if number is not None and groups and len(groups) != number:
            raise ValueError(
                f"`loss_scale_groups` has {len(groups)} groups but the loss "
                f"scale status has loss_scale_number={number}"
            )

    @property
    def markers(self):
        """The markers made so far, ordered by `first`."""
        return [self._markers[key] for key in sorted(self._markers)]

    def marker(self, first, second):
        """The `LossScaleGroup` of the pair `(first, second)` (made once)."""
        first, second = check_marker_indices(first, second)
        self._check_in_range(self.loss_scale_number, first, second)
        if (first, second) not in self._markers:
            marker = LossScaleGroup(
                first,
                second,
                manager_name=self.name,
                name=f"{self.name}_{first}_{second}",
            )
            if self._status_scales is not None:
                marker.first_scale.assign(self._status_scales[first])
                marker.second_scale.assign(self._status_scales[second])
            self._markers[(first, second)] = marker
        return self._markers[(first, second)]

    def __call__(self, x, first, second):
        """`x` through the marker `(first, second)`: MindSpore's
        `construct(x, layer1, layer2)`."""
        return self.marker(first, second)(x)

    def _check_in_range(self, number, first, second):
        if number is not None and second > number + 1:
            raise ValueError(
                f"Marker ({first}, {second}) is beyond the {number} loss "
                f"scale groups: marker indices go up to {number + 1}"
            )

    def set_loss_scale_status(self, loss_scale_number, init_loss_scale):
        """Sets `s[0..n+1] = 1`, then `s[1..n] = init_loss_scale` (or
        `init_loss_scale[j]` for `s[j+1]`), in every marker."""
        number = check_int("loss_scale_number", loss_scale_number, minimum=1)
        init = _check_init_loss_scale(init_loss_scale)
        if not isinstance(init, list):
            init = [init] * number
        elif len(init) != number:
            raise ValueError(
                "Argument `init_loss_scale` must have one scale per group, "
                f"loss_scale_number={number}. Received: "
                f"init_loss_scale={init_loss_scale!r} (of length {len(init)})"
            )
        self._check_group_count(number, self._loss_scale_groups)
        for first, second in self._markers:
            self._check_in_range(number, first, second)
        self.loss_scale_number = number
        self._status_scales = [1.0, *init, 1.0]
        for marker in self._markers.values():
            marker.first_scale.assign(self._status_scales[marker.first])
            marker.second_scale.assign(self._status_scales[marker.second])

    def _chain(self):
        """The markers `(0, 1), ..., (n, n+1)`; raises if one is missing."""
        if self.loss_scale_number is None:
            raise ValueError(
                "The loss scale status is not set: call "
                "`set_loss_scale_status(loss_scale_number, init_loss_scale)`"
                " first."
            )
        pairs = [(g, g + 1) for g in range(self.loss_scale_number + 1)]
        missing = [pair for pair in pairs if pair not in self._markers]
        if missing:
            raise ValueError(
                f"Manager '{self.name}' has no markers for the pairs "
                f"{missing}: place `manager(x, first, second)` at every "
                f"boundary (0, 1) ... ({self.loss_scale_number}, "
                f"{self.loss_scale_number + 1})."
            )
        return [self._markers[pair] for pair in pairs]

    @property
    def scales(self):
        """`s[0..n+1]`, a float32 tensor read from the markers (also
        inside a traced function)."""
        chain = self._chain()
        return ops.stack(
            [chain[0].first_scale.value] + [m.second_scale.value for m in chain]
        )

    def assign_scales(self, scales):
        """Writes `s[0..n+1]` (shape `(n+2,)`) into every marker (also
        inside a traced function)."""
        chain = self._chain()
        scales = ops.convert_to_tensor(scales, dtype="float32")
        expected = (self.loss_scale_number + 2,)
        if tuple(scales.shape) != expected:
            raise ValueError(
                f"Argument `scales` must have shape {expected}. "
                f"Received: scales with shape {tuple(scales.shape)}"
            )
        for marker in chain:
            marker.first_scale.assign(scales[marker.first])
            marker.second_scale.assign(scales[marker.second])

    def get_loss_scale(self):
        """The scales of the groups, `s[1..n]`: a float32 NumPy array
        (MindSpore returns the initial scale it was given)."""
        return numpy_value(self.scales)[1:-1]

    def get_update_cell(self):
        """This manager, which updates the scales (as in MindSpore)."""
        return self

    def group_of_variables(self, variables):
        """The group index `j` of each variable (a list of ints)."""
        if not self._loss_scale_groups:
            raise ValueError(
                "`loss_scale_groups` is not set: assign a list of lists of "
                "variables to `manager.loss_scale_groups` first."
            )
        groups = []
        for variable in variables:
            if id(variable) not in self._group_of:
                path = getattr(variable, "path", variable)
                raise ValueError(
                    f"Variable `{path}` is in no loss scale group of "
                    f"manager '{self.name}'"
                )
            groups.append(self._group_of[id(variable)])
        return groups

    @classmethod
    def from_model(
        cls, model, init_loss_scale, loss_scale_groups=None, name=None
    ):
        """A manager of the markers already in `model` (a loaded one).

        Its status is the markers' scales (`n` from the last marker); it
        makes no new scales. `name` selects the markers' `manager_name`
        and may be left out when the model has one chain.
        """
        markers = _model_markers(model)
        names = sorted({marker.manager_name for marker in markers})
        if name is None and len(names) == 1:
            name = names[0]
        if name not in names:
            raise ValueError(
                f"Argument `name` must name the markers of one manager in "
                f"the model, one of {names}. Received: name={name!r}"
            )
        manager = cls(init_loss_scale, loss_scale_groups, name=name)
        for marker in markers:
            if marker.manager_name != name:
                continue
            pair = (marker.first, marker.second)
            if pair in manager._markers:
                raise ValueError(
                    f"The model has two markers of manager '{name}' for the "
                    f"pair {pair}: {manager._markers[pair].name} and "
                    f"{marker.name}"
                )
            manager._markers[pair] = marker
        number = max(second for _, second in manager._markers) - 1
        if number < 1:
            raise ValueError(
                f"The markers of manager '{name}' make no loss scale group: "
                f"found only {sorted(manager._markers)}"
            )
        manager._check_group_count(number, manager._loss_scale_groups)
        manager.loss_scale_number = number
        scales = numpy_value(manager.scales)
        for marker in manager.markers[1:]:
            if numpy_value(marker.first_scale) != scales[marker.first]:
                raise ValueError(
                    f"Marker {marker.name} holds s[{marker.first}]="
                    f"{numpy_value(marker.first_scale)} but its neighbour "
                    f"holds {scales[marker.first]}"
                )
        manager._status_scales = scales.tolist()
        return manager

    def attach(self, model):
        """Points this manager at the markers in `model` (a rebuilt or
        loaded copy of the model it built, e.g. `to_boost_model`'s) and
        its groups at `model`'s variables of the same paths."""
        found = GroupLossScaleManager.from_model(
            model, self.init_loss_scale, name=self.name
        )
        groups = None
        if self._loss_scale_groups:
            by_path = {v.path: v for v in model.trainable_variables}
            groups = [
                [by_path[v.path] for v in group if v.path in by_path]
                for group in self._loss_scale_groups
            ]
        self._markers = found._markers
        self.loss_scale_number = found.loss_scale_number
        self._status_scales = found._status_scales
        self.loss_scale_groups = groups

    def get_config(self):
        """The constructor's settings; `loss_scale_groups` (variables) are
        not part of it."""
        return {"init_loss_scale": self.init_loss_scale, "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
