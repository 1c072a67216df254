"""Measure the ladder: ``compare_optimization_levels`` and its command line, ``python -m profiling``."""

from .compare import COLUMNS, compare_optimization_levels, perturb_parameters_
from .peaks import copy_bandwidth, describe_device
from .report import format_table, plot_comparison
from .timing import Timing, time_runs

__all__ = [
    "COLUMNS",
    "Timing",
    "compare_optimization_levels",
    "copy_bandwidth",
    "describe_device",
    "format_table",
    "perturb_parameters_",
    "plot_comparison",
    "time_runs",
]
