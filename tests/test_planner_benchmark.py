"""The planner-peak benchmark (``python -m benchmarks.planner_peak``): its measuring function on a tiny model.

One real measurement on 4 forked CPU ranks (gloo): FSDP1 at degree 2, a model of about 0.47 M parameters. No
verdict is asserted (how close the planner comes is what the benchmark reports), only that the measurement and its
results row are sound.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.planner_peak import PHASES, SIZES, bench_settings, compare, measure, predict


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_model_measured_peak_and_results_row() -> None:
    settings = bench_settings(SIZES["tiny"], world_size=4)
    measured = measure(settings, degree=2, engine=1, timeout=240)
    predicted = predict(settings, engine=1, degrees=[2])[2]

    assert measured["peak_bytes"] > 0
    assert len(measured["rank_peak_bytes"]) == 4 and min(measured["rank_peak_bytes"]) > 0
    # the step's peak is above what existed when it began: the model state, which the planner predicts exactly
    assert measured["peak_bytes"] > measured["start_bytes"] == predicted["model_state_bytes"]
    assert measured["peak_phase"] in PHASES and max(measured["phase_peak_bytes"].values()) == measured["peak_bytes"]

    row = json.loads(json.dumps(compare("tiny", settings.model.parameter_count(), 1, 2, predicted, measured)))
    assert {"size", "parameters", "engine", "degree", "predicted_peak_bytes", "measured_peak_bytes",
            "predicted_over_measured", "within_tolerance", "predicted", "measured"} <= set(row)
    assert {"model_state_bytes", "transient_bytes", "buffer_bytes", "activation_bytes"} <= set(row["predicted"])
    assert (row["engine"], row["degree"], row["measured_peak_bytes"]) == ("FSDP1", 2, measured["peak_bytes"])
    assert row["predicted_over_measured"] == pytest.approx(row["predicted_peak_bytes"] / row["measured_peak_bytes"])
