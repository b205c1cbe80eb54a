"""`omniflow bench stream` with small figures: it runs, and its back-pressured producer stays
within the bound it reports (the figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import argparse

from engine.bench import stream as bench


def test_the_stream_bench_reports_its_keys():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--frames", "300", "--runs", "1", "--slow-frames", "200",
                                          "--slow-read-us", "50", "--window", "4", "--capacity", "4"]))
    assert result["lead_bound_frames"] == 2 * 4 + 4 + 2
    assert 4 <= result["max_lead_frames"] <= result["lead_bound_frames"]
    assert result["frames_per_s"] > 0 and result["unbounded_frames_per_s"] > 0
    assert {"throughput_ratio", "unbounded_max_lead_frames", "meets_goal"} <= set(result)
