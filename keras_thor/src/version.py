"""The single place that holds the keras_thor version."""

__version__ = "0.2.0"
