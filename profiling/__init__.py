"""Measure the ladder: ``compare_optimization_levels``, ``call_overhead`` and the command line, ``python -m profiling``."""

from .compare import COLUMNS, compare_optimization_levels, perturb_parameters_
from .overhead import DECODE_CASES, call_overhead, format_overhead
from .peaks import copy_bandwidth, describe_device
from .report import format_table, plot_comparison, with_setup_columns
from .timing import Timing, time_back_to_back, time_runs

__all__ = [
    "COLUMNS",
    "DECODE_CASES",
    "Timing",
    "call_overhead",
    "compare_optimization_levels",
    "copy_bandwidth",
    "describe_device",
    "format_overhead",
    "format_table",
    "perturb_parameters_",
    "plot_comparison",
    "time_back_to_back",
    "time_runs",
    "with_setup_columns",
]
