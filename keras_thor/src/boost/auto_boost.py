"""`AutoBoost`: MindSpore's boost levels and configuration for Keras."""

import copy
import json
import os
import warnings

import keras

from keras_thor.src.boost.adasum import AdaSum
from keras_thor.src.boost.boost_model import to_boost_model
from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.boost_optimizer import wiring_of
from keras_thor.src.boost.centralization import centralized_variable_paths
from keras_thor.src.boost.dim_reduce import DimReduce
from keras_thor.src.boost.gradient_freeze import GradientFreeze
from keras_thor.src.boost.group_loss_scale import GroupLossScale
from keras_thor.src.boost.less_bn import LessBN
from keras_thor.src.boost.less_bn import is_bypassed
from keras_thor.src.boost.less_bn import removable_layers
from keras_thor.src.distribute import replicas
from keras_thor.src.utils.validation import check_bool
from keras_thor.src.utils.validation import check_int

ALGORITHMS = (
    "less_bn",
    "grad_freeze",
    "adasum",
    "grad_accumulation",
    "dim_reduce",
    "loss_scale_group",
)
LEVELS = {
    "O0": (),
    "O1": ("less_bn", "grad_freeze"),
    "O2": ("less_bn", "grad_freeze", "adasum"),
}
MODES = ("auto", "manual", "enable_all", "disable_all")
# Need more than the model and optimizer (stage-1 snapshots, a manager):
# `enable_all` leaves them off.
NEEDS_INPUT = ("dim_reduce", "loss_scale_group")
# The `BoostOptimizer` argument of each switch that has one: its wiring
# says what it refuses beside it and whether it runs alone.
ARGUMENTS = {
    "grad_freeze": "grad_freeze",
    "adasum": "adasum",
    "grad_accumulation": "grad_accumulation_step",
    "dim_reduce": "dim_reduce",
    "loss_scale_group": "group_loss_scale",
}
# Run alone: the others are turned off.
ALONE = tuple(
    switch
    for switch, argument in ARGUMENTS.items()
    if wiring_of(argument).runs_alone
)
# Every section's keys and defaults (MindSpore's), plus `seed`.
DEFAULTS = {
    "boost": {"mode": "auto", **dict.fromkeys(ALGORITHMS, False)},
    "common": {
        "gradient_split_groups": None,
        "device_number": 8,
        "grad_accumulation_step": 1,
    },
    "less_bn": {"fn_flag": True, "gc_flag": True},
    "grad_freeze": {
        "param_groups": 10,
        "freeze_type": 1,
        "freeze_p": 0.7,
        "total_steps": 65536,
        "seed": 0,
    },
    "adasum": {"device_number": 8},
    "grad_accumulation": {"grad_accumulation_step": 1},
    "dim_reduce": {
        "rho": 0.55,
        "gamma": 0.9,
        "alpha": 0.001,
        "sigma": 0.4,
        "n_components": 32,
        "pca_mat_path": None,
        "weight_load_dir": None,
        "timeout": 1800,
    },
    "loss_scale_group": {},
}


def _refuses(switch, other):
    """Whether the algorithm of `switch` does not run beside that of
    `other` (the rule `BoostOptimizer` enforces)."""
    return ARGUMENTS[other] in wiring_of(ARGUMENTS[switch]).refuses


def _has_removable_batch_normalizations(model):
    """Whether `LessBN` would bypass a BatchNormalization of `model` (or
    of a model nested in it) that runs now."""
    if not isinstance(model, keras.Model) or not model.built:
        return False
    return any(not is_bypassed(layer) for layer in removable_layers(model))


def _check_not_built(optimizer):
    if getattr(optimizer, "built", False):
        raise ValueError(
            "Argument `optimizer` must not be built yet: boost builds it "
            "on the variables the changed model trains. Received: a built "
            f"{type(optimizer).__name__}"
        )


def _choices(values):
    return ", ".join(repr(v) for v in values)


def _read_config(boost_config_dict):
    if isinstance(boost_config_dict, str):
        if not boost_config_dict:
            return {}
        if not os.path.isfile(boost_config_dict):
            raise ValueError(
                "Argument `boost_config_dict` must be a dict or the path of "
                "a JSON file. Received: "
                f"boost_config_dict={boost_config_dict!r} (no such file)"
            )
        with open(boost_config_dict) as file:
            boost_config_dict = json.load(file)
    if not isinstance(boost_config_dict, dict):
        raise TypeError(
            "Argument `boost_config_dict` must be a dict or the path of a "
            f"JSON file. Received: boost_config_dict={boost_config_dict!r}"
        )
    return boost_config_dict


def _merged(config):
    """`DEFAULTS` updated with `config`; unknown names are errors."""
    merged = copy.deepcopy(DEFAULTS)
    for section, values in config.items():
        if section not in DEFAULTS:
            raise ValueError(
                f"Unknown section {section!r} in `boost_config_dict`. "
                f"Valid sections: {_choices(DEFAULTS)}"
            )
        if not isinstance(values, dict):
            raise TypeError(
                f"Section {section!r} of `boost_config_dict` must be a dict. "
                f"Received: {values!r}"
            )
        for key, value in values.items():
            if key not in DEFAULTS[section]:
                raise ValueError(
                    f"Unknown key {key!r} in section {section!r} of "
                    "`boost_config_dict`. Valid keys: "
                    f"{_choices(DEFAULTS[section]) or 'none'}"
                )
            merged[section][key] = value
    return merged


def _flags(level, merged, given):
    """Which algorithms run, from the level's preset and the mode."""
    mode = merged["boost"]["mode"]
    if mode not in MODES:
        raise ValueError(
            "Key 'mode' of section 'boost' must be one of "
            f"{_choices(MODES)}. Received: mode={mode!r}"
        )
    flags = {name: name in LEVELS[level] for name in ALGORITHMS}
    explicit = [name for name in ALGORITHMS if name in given]
    if explicit and mode != "manual":
        raise ValueError(
            f"Switches {explicit} of section 'boost' apply only with "
            f"mode='manual'. Received: mode={mode!r}"
        )
    if mode == "manual":
        for name in explicit:
            flags[name] = check_bool(name, merged["boost"][name])
    elif mode == "enable_all":
        flags = {name: name not in NEEDS_INPUT for name in ALGORITHMS}
    elif mode == "disable_all":
        flags = dict.fromkeys(ALGORITHMS, False)
    return flags


class AutoBoost:
    """MindSpore's boost levels for a Keras model and optimizer.

    | level | algorithms |
    |---|---|
    | `"O0"` | none |
    | `"O1"` | LessBN (+ FullNorm head, centralization), gradient freezing |
    | `"O2"` | O1 + AdaSum |

    `boost_config_dict` (a dict, or the path of a JSON file) has MindSpore's
    sections: `boost` (`mode`: `"auto"` takes the level's preset,
    `"manual"` the level's preset changed by the switches given,
    `"enable_all"`/`"disable_all"`; switches `less_bn`, `grad_freeze`,
    `adasum`, `grad_accumulation`, `dim_reduce`, `loss_scale_group`),
    `common`, `less_bn`, `grad_freeze`, `adasum`, `grad_accumulation`,
    `dim_reduce`, `loss_scale_group`. Unknown sections, keys, levels and
    modes are errors that list the valid ones. Each object keeps its own
    configuration (MindSpore's is a process-wide singleton).

    How the algorithms combine (docs/boost.md):
        - gradient freezing turns gradient accumulation off (with a
          warning), as MindSpore's training cell does;
        - AdaSum needs several replicas: with one it is off (warning);
        - `dim_reduce` runs alone: the level's other algorithms are off
          (warning), as MindSpore's training cell takes its branch only;
          `enable_all` leaves it off (it needs stage-1 snapshots);
        - `loss_scale_group` runs alone too (MindSpore's loss-scale cell
          has no freezing branch); `network_auto_process_train` then
          needs the `GroupLossScaleManager` (`loss_scale_manager`).

    Args:
        level: `"O0"`, `"O1"` or `"O2"`.
        boost_config_dict: A dict, a JSON file path, or `""` (defaults).
    """

    def __init__(self, level="O0", boost_config_dict=""):
        if level not in LEVELS:
            raise ValueError(
                f"Argument `level` must be one of {_choices(LEVELS)}. "
                f"Received: level={level!r}"
            )
        self.level = level
        config = _read_config(boost_config_dict)
        self.config = _merged(config)
        self.flags = _flags(level, self.config, config.get("boost", {}))
        self._alone()
        self.grad_accumulation_step = check_int(
            "grad_accumulation_step", self._accumulation_step(config), 1
        )
        self.device_number = check_int(
            "device_number",
            self.config["adasum"]["device_number"]
            if "device_number" in config.get("adasum", {})
            else self.config["common"]["device_number"],
            minimum=1,
        )
        self.fn_flag = check_bool("fn_flag", self.config["less_bn"]["fn_flag"])
        self.gc_flag = check_bool("gc_flag", self.config["less_bn"]["gc_flag"])
        self.grad_freeze = (
            GradientFreeze(**self.config["grad_freeze"])
            if self.flags["grad_freeze"]
            else None
        )
        if (
            self.grad_freeze is not None
            and self.flags["grad_accumulation"]
            and _refuses("grad_freeze", "grad_accumulation")
        ):
            warnings.warn(
                "Gradient freezing turns gradient accumulation off (as in "
                "MindSpore).",
                stacklevel=2,
            )
            self.flags["grad_accumulation"] = False

    def _alone(self):
        """DimReduce or group loss scaling, with the others turned off."""
        self.dim_reduce = None
        alone = [name for name in ALONE if self.flags[name]]
        if len(alone) > 1:
            raise ValueError(
                "`dim_reduce` and `loss_scale_group` do not combine in this "
                "version. Received: boost switches "
                f"{ {name: True for name in alone} }"
            )
        if not alone:
            return
        (name,) = alone
        others = [n for n in ALGORITHMS if n != name and self.flags[n]]
        if others:
            warnings.warn(
                f"`{name}` runs alone: {others} are off (MindSpore's "
                f"training cell takes the {name} branch only).",
                stacklevel=3,
            )
        self.flags = {n: n == name for n in ALGORITHMS}
        if name == "dim_reduce":
            self.dim_reduce = DimReduce(**self.config["dim_reduce"])

    def _accumulation_step(self, config):
        for section in ("grad_accumulation", "common"):
            if "grad_accumulation_step" in config.get(section, {}):
                return config[section]["grad_accumulation_step"]
        return 1

    def network_auto_process_train(
        self, model, optimizer, loss_scale_manager=None
    ):
        """`(model, optimizer, callbacks)` to compile and fit with.

        The model is changed in place (LessBN) and given boost's
        training steps (`to_boost_model`), and the optimizer wrapped in a
        `BoostOptimizer`; with every algorithm off both are returned as
        they are. The optimizer must not have been built on other
        variables (MindSpore builds a new one, too).
        `callbacks` holds the `DimReduce` or `GroupLossScale` callback
        when `dim_reduce` or `loss_scale_group` is on.

        Args:
            model: A built `keras.Model`.
            optimizer: A `keras.optimizers.Optimizer` (`SGD(1.0)` for
                DimReduce).
            loss_scale_manager: The `keras_thor.boost.GroupLossScaleManager`
                whose markers `model` holds (MindSpore's
                `Model(loss_scale_manager=...)`); needed with
                `loss_scale_group` on.
        """
        flags = self.flags
        if flags["dim_reduce"]:
            return self._dim_reduce_process(model, optimizer)
        if flags["loss_scale_group"]:
            return self._group_loss_scale_process(
                model, optimizer, loss_scale_manager
            )
        accumulation = (
            self.grad_accumulation_step if flags["grad_accumulation"] else 1
        )
        adasum = self._adasum() if flags["adasum"] else None
        if not (
            flags["less_bn"]
            or flags["grad_freeze"]
            or accumulation > 1
            or adasum is not None
        ):
            return model, optimizer, []
        _check_not_built(optimizer)
        if flags["less_bn"]:
            model = LessBN(model, fn_flag=self.fn_flag)
        else:
            model = to_boost_model(model)
        centralized = (
            centralized_variable_paths(model)
            if flags["less_bn"] and self.gc_flag
            else []
        )
        optimizer = BoostOptimizer(
            optimizer,
            grad_accumulation_step=accumulation,
            grad_freeze=self.grad_freeze,
            centralized_variables=centralized,
            adasum=adasum,
        )
        return model, optimizer, []

    def _dim_reduce_process(self, model, optimizer):
        """A boost model, `BoostOptimizer(optimizer, dim_reduce=...)` and
        the `DimReduce` callback; `P` is loaded or computed now."""
        _check_not_built(optimizer)
        dim_reduce = DimReduce.from_config(self.dim_reduce.get_config())
        model = to_boost_model(model)
        optimizer = BoostOptimizer(optimizer, dim_reduce=dim_reduce)
        dim_reduce.prepare(model)
        return model, optimizer, [dim_reduce]

    def _group_loss_scale_process(self, model, optimizer, manager):
        """A boost model, `BoostOptimizer(optimizer, group_loss_scale=...)`
        and the `GroupLossScale` callback (MindSpore takes the manager as
        `Model(loss_scale_manager=...)`)."""
        if manager is None:
            raise ValueError(
                "With `loss_scale_group` on, pass the model's "
                "`keras_thor.boost.GroupLossScaleManager` as "
                "`loss_scale_manager`. Received: loss_scale_manager=None"
            )
        _check_not_built(optimizer)
        scaling = GroupLossScale(manager)
        model = to_boost_model(model)
        optimizer = BoostOptimizer(optimizer, group_loss_scale=scaling)
        return model, optimizer, [scaling]

    def network_auto_process_eval(self, model):
        """The model to evaluate or predict with.

        With LessBN on, a model that still runs batch normalizations
        LessBN bypasses gets them bypassed, in place, its head unchanged
        (MindSpore evaluates with `LessBN(network)`, `fn_flag` False):
        only training puts a `FullNorm` head in. The model
        `network_auto_process_train` returned has them bypassed already
        and is returned as it is, with its trained `FullNorm` head.
        """
        if self.flags["less_bn"] and _has_removable_batch_normalizations(model):
            return LessBN(model, fn_flag=False)
        return model

    def _adasum(self):
        """An `AdaSum` for the current strategy's replicas, or None (with a
        warning) when they form a single group, as on one device."""
        device_number = self.device_number
        adasum = AdaSum(device_number)
        count = replicas.replica_count()
        if count <= device_number:
            warnings.warn(
                f"AdaSum combines groups of device_number={device_number} "
                f"replicas; {count} replica(s) make one group, so it is off "
                "(set `device_number` in the 'adasum' section to use it "
                "across these replicas).",
                stacklevel=3,
            )
            return None
        adasum.group_count(count)
        return adasum
