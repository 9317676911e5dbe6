"""The state of one curvature option, kept beside the option's code.

The `CurvatureEstimator` keeps what every setting of THOR needs (the
inverses, the count of curvature troubles) and one `OptionState` per
option that is on. The option states are created after the estimator's
own variables, in the fixed order of their registry
(`estimator.OPTION_STATES`): THOR's variables load by position, so that
order is the saved files' order.

An option added later writes its own subclass beside its code, adds its
field to `CurvatureOptions`, and registers its class at the end of
`OPTION_STATES` (the end: files saved before it then still load).
"""


class OptionState:
    """One curvature option's variables and what it logs (a base class;
    a subclass names its `option` field).

    Args:
        options: THOR's `CurvatureOptions`.
        table: `{variable index: (name, A⁻¹, G⁻¹)}` of the blocks, in
            block order (`name` is the kernel's path with `_` for `/`;
            `A⁻¹`, `G⁻¹` the inverse variables).
        add_variable: THOR's `add_variable`.
    """

    # The `CurvatureOptions` field that switches the option on.
    option = None

    def __init__(self, options, table, add_variable):
        self.options = options

    @classmethod
    def enabled(cls, options):
        """Whether `options` switch the option on: its field is set."""
        return getattr(options, cls.option) is not None

    def block_state(self, index, position):
        """The `BlockState` fields this option keeps for block `index`
        (at `position` in block order), as NumPy values."""
        return {}

    def training_logs(self):
        """`{name: scalar}` for the step's logs."""
        return {}
