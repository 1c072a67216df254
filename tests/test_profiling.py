"""compare_optimization_levels and ``python -m profiling``: the table a learner reads must be complete,
honest about what could not run, and written to CSV and PNG on request."""

import pandas as pd
import pytest
import torch
from torch import nn

import levels
from profiling import COLUMNS, compare_optimization_levels, format_table
from profiling.cli import main


def test_one_row_per_level_plus_reference_rows():
    # Triton runs CPU tensors only through its interpreter, i.e. only where no GPU is present.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = compare_optimization_levels("layer_norm", (16, 64), device=device, levels=["native", 4, "cuda"],
                                        backward=True, budget_s=0.05, progress=False)
    assert list(table.columns) == COLUMNS
    assert list(table["level"]) == ["1 native PyTorch", "4 Triton", "5 CUDA C++", "F.layer_norm (PyTorch fused)"]
    assert list(table["kind"]) == ["level", "level", "level", "reference"]
    assert (table["status"] == "ok").all(), table["status"].tolist()
    assert table["within_tolerance"].all()
    assert table["speedup_vs_level_1"].iloc[0] == pytest.approx(1.0)
    assert (table["median_ms"] > 0).all() and (table["GB/s"] > 0).all() and (table["pct_copy_bandwidth"] > 0).all()
    assert (table["p10_ms"] <= table["median_ms"]).all() and (table["median_ms"] <= table["p90_ms"]).all()
    assert table.attrs["backward"] is True and table.attrs["input_shape"] == (16, 64)


def test_a_level_that_cannot_run_says_why_and_the_rest_still_run():
    table = compare_optimization_levels("swish", (8, 8), dtype=torch.bfloat16, device="cpu",
                                        levels=["native", "triton"], references=False, budget_s=0.02, progress=False)
    native, triton = table.itertuples()
    assert native.status == "ok"
    assert triton.status.startswith("TypeError") and "float32, float64" in triton.status
    assert "not run:" in format_table(table)


def test_a_dict_of_modules_is_compared_against_its_first_entry():
    class Doubling(nn.Module):
        def forward(self, x):
            return x * 2

    class AlmostDoubling(nn.Module):
        def forward(self, x):
            return x * 2.01

    table = compare_optimization_levels({"exact": Doubling(), "off": AlmostDoubling()}, (32,), device="cpu",
                                        budget_s=0.02, progress=False)
    exact, off = table.itertuples()
    assert exact.max_error == 0 and exact.within_tolerance
    assert off.max_error == pytest.approx(0.005, rel=1e-3) and not off.within_tolerance


def test_the_command_line_prints_the_table_and_writes_csv_and_png(tmp_path, capsys):
    csv, png = tmp_path / "comparison.csv", tmp_path / "comparison.png"
    status = main(["--component", "swish", "layer_norm", "--shape", "8", "32", "--device", "cpu", "--levels", "1", "3",
                   "--budget", "0.02", "--csv", str(csv), "--plot", str(png)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "swish forward" in printed and "layer_norm forward" in printed and "3 torch.compile" in printed
    written = pd.read_csv(csv)
    assert set(written["component"]) == {"swish", "layer_norm"}
    assert len(written) == 2 * 2 + 2  # two levels and one reference row per component
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
