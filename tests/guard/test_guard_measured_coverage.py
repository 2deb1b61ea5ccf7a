"""The closing line of ``sdcscope train --guard`` quotes what the coverage matrix measured for the
profile (silent transient GEMM faults detected, per site), from the file the benchmark writes."""

import json

from sdcscope.guard.config import PROFILES
from sdcscope.guard.coverage import MEASURED, measured_catch


def test_the_line_gives_each_sites_count_and_the_command(tmp_path):
    f = tmp_path / "m.json"
    silent = {"balanced": {"Y": [1, 6], "dX": [2, 5], "dW": [0, 0]}}
    f.write_text(json.dumps({"command": "python bench --x", "workload": "tiny GPT", "silent": silent}))
    line = measured_catch("balanced", f)
    assert "detected 3 of 11 silent transient GEMM faults (Y 1/6, dX 2/5)" in line
    assert "tiny GPT" in line and "python bench --x" in line
    assert measured_catch("full", f) is None  # nothing measured for it: no line rather than a guess
    f.write_text("{not json")
    assert measured_catch("balanced", f) is None


def test_the_shipped_measurement_covers_every_profile_and_gemm_site():
    data = json.loads(MEASURED.read_text())
    assert data["schedules"] == ["transient"] and not data["compiled"]
    for profile in PROFILES:
        counts = data["silent"][profile]
        assert set(counts) == {"Y", "dX", "dW"}
        assert all(0 <= k <= n for k, n in counts.values()) and sum(n for _, n in counts.values()) > 0
        assert measured_catch(profile).startswith(f"profile {profile} detected")
