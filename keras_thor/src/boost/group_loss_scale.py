"""`GroupLossScale`: training with one dynamic loss scale per group."""

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost import boost_callbacks
from keras_thor.src.boost.group_loss_scale_manager import GroupLossScaleManager
from keras_thor.src.utils.validation import check_float

GROWTH = 2.0 ** (1 / 1000)
BACKOFF = 2.0**-0.5


def _check_factor(name, value, above_one):
    value = check_float(name, value)
    if (value > 1.0) != above_one or value <= 0.0:
        bound = "> 1" if above_one else "in (0, 1)"
        raise ValueError(
            f"Argument `{name}` must be a float {bound}. "
            f"Received: {name}={value!r}"
        )
    return value


def _paths(groups):
    if not groups:
        raise ValueError(
            "The manager's `loss_scale_groups` are not set: assign a list "
            "of lists of variables to `manager.loss_scale_groups` first. "
            f"Received: manager.loss_scale_groups={groups!r}"
        )
    return [[variable.path for variable in group] for group in groups]


@keras_thor_export
class GroupLossScale(boost_callbacks.BoostCallback):
    """Trains with one dynamic loss scale per group of variables:
    MindSpore's `BoostTrainOneStepWithLossScaleCell` with a
    `GroupLossScaleManager`, as a Keras callback.

    Each step, after the backward pass (which the manager's markers scale
    per segment):

    ```
    overflow_j = some gradient of group j, or the gradient its segment
                 passes on (its marker's probe), is not finite (on any
                 replica)
    s[j+1] ← s[j+1] · (backoff_factor if overflow_j else growth_factor)
    any overflow_j: the step is skipped (weights and optimizer untouched)
    else: g_p ← g_p / s_old[j(p) + 1]; the optimizer applies g
    ```

    Notation:
        - `s`: the manager's scales, `s[j+1]` for group `j`; `s_old` the
          scales the backward pass ran at.
        - `j(p)`: the group of variable `p`.

    Pass it to `fit(callbacks=[...])` of a boost model
    (`keras_thor.boost.to_boost_model`) built with the manager's markers:
    it wraps the compiled optimizer in a `BoostOptimizer` that runs the
    rule above. A `keras.optimizers.LossScaleOptimizer` (which Keras puts
    around the optimizer under `mixed_float16`) is unwrapped: the group
    scales replace its global scale. The groups are found in the model by
    variable path, the markers by the manager's name, so the callback
    works on a rebuilt or loaded model; the manager passed in is attached
    to the model trained (`GroupLossScaleManager.attach`), so its
    `get_loss_scale()` follows training. A manager whose status was never
    set gets `set_loss_scale_status(len(groups), init_loss_scale)` on the
    model's markers, as MindSpore's training cell does. The scales
    (`group_{j}_loss_scale`) and each group's overflow count
    (`group_{j}_overflows`) are logged. The scales grow no further than
    2^126.

    Args:
        manager: The `keras_thor.boost.GroupLossScaleManager` whose markers
            the model holds, with its `loss_scale_groups` set.
        growth_factor: Float > 1, the scale's growth after a step without
            overflow (MindSpore: `2^(1/1000)`).
        backoff_factor: Float in (0, 1), the scale's factor after an
            overflow (MindSpore: `2^(−1/2)`).
    """

    def __init__(
        self,
        manager=None,
        growth_factor=GROWTH,
        backoff_factor=BACKOFF,
        *,
        manager_name=None,
        init_loss_scale=None,
        group_paths=None,
    ):
        super().__init__()
        self.growth_factor = _check_factor("growth_factor", growth_factor, True)
        self.backoff_factor = _check_factor(
            "backoff_factor", backoff_factor, False
        )
        if manager is not None:
            if not isinstance(manager, GroupLossScaleManager):
                raise TypeError(
                    "Argument `manager` must be a "
                    "`keras_thor.boost.GroupLossScaleManager`. "
                    f"Received: manager={manager!r}"
                )
            manager_name = manager.name
            init_loss_scale = manager.init_loss_scale
            group_paths = _paths(manager.loss_scale_groups)
            # The callback sets the status when the user did not.
            self._sets_status = manager.loss_scale_number is None
        elif manager_name is None or group_paths is None:
            raise ValueError(
                "Argument `manager` must be a "
                "`keras_thor.boost.GroupLossScaleManager`. Received: "
                "manager=None"
            )
        else:
            self._sets_status = False  # restored: the markers hold them
        self.manager_name = manager_name
        self.init_loss_scale = init_loss_scale
        self.group_paths = [list(group) for group in group_paths]
        # The user's manager follows the model trained (`attach`).
        self._given_manager = manager
        self._status_markers = None
        self.manager = None

    @property
    def group_count(self):
        """The number of groups `n`."""
        return len(self.group_paths)

    def set_model(self, model):
        super().set_model(model)
        if getattr(model, "optimizer", None) is None:
            return
        boost_callbacks.install(
            self, model, "group_loss_scale", unwrap_loss_scale=True
        )
        # The callback that runs (a restored one keeps its scales).
        model.optimizer.group_loss_scale.bind(model)

    def bind(self, model):
        """Finds the manager's markers and the groups' variables in
        `model`; sets the initial status if it was never set."""
        groups = self._resolve(model)
        if self._given_manager is not None:
            manager = self._given_manager
            manager.attach(model)
        else:
            manager = GroupLossScaleManager.from_model(
                model, self.init_loss_scale, groups, name=self.manager_name
            )
        if manager.loss_scale_number != self.group_count:
            raise ValueError(
                f"The model's markers of manager '{self.manager_name}' make "
                f"{manager.loss_scale_number} groups, but the manager has "
                f"{self.group_count} `loss_scale_groups`"
            )
        markers = [id(marker) for marker in manager.markers]
        if self._sets_status and markers != self._status_markers:
            # Once per model: later binds (each `fit`) keep the scales.
            manager.set_loss_scale_status(
                self.group_count, self.init_loss_scale
            )
            self._status_markers = markers
        self.manager = manager
        return manager

    def overflow_probes(self):
        """The `overflow_probe` of markers `(j, j+1)`, `j < n`: the
        gradient of probe `j` is 1 when segment `j + 1` (group `j`)
        overflowed in its backward pass."""
        return [marker.overflow_probe for marker in self.manager.markers[:-1]]

    def _resolve(self, model):
        by_path = {v.path: v for v in model.trainable_variables}
        missing = [p for g in self.group_paths for p in g if p not in by_path]
        if missing:
            raise ValueError(
                f"Variables {missing} of the loss scale groups are not "
                "trainable variables of the model"
            )
        grouped = {p for g in self.group_paths for p in g}
        outside = [p for p in by_path if p not in grouped]
        if outside:
            raise ValueError(
                f"Trainable variables {outside} are in no loss scale group: "
                "every trained variable needs a group (its gradient's "
                "scale)"
            )
        return [[by_path[p] for p in group] for group in self.group_paths]

    def groups_of(self, variables):
        """The group index of each of `variables` (a list of ints)."""
        return self.manager.group_of_variables(variables)

    def get_config(self):
        return {
            "manager_name": self.manager_name,
            "init_loss_scale": self.init_loss_scale,
            "group_paths": self.group_paths,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return (
            f"GroupLossScale(manager_name={self.manager_name!r}, "
            f"groups={self.group_count}, growth_factor="
            f"{self.growth_factor!r}, backoff_factor={self.backoff_factor!r})"
        )
