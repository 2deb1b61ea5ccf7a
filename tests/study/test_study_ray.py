"""The optional Ray backend gives the same rows as the local worker processes (skipped without Ray)."""

import pytest

from helpers import campaign_tables
from sdcscope.study import init_campaign, run_campaign

ray = pytest.importorskip("ray")

SPEC = """
name: ray-vs-local
workload: {name: cnn, preset: tiny}
inject_steps: [3]
horizon: 4
faults:
  sites: [gemm.forward, weight]
  targets: [conv2, fc1]
  models: [bitflip]
  bits: [22, 30]
  patterns: [{kind: element}]
baseline: {seeds: [1, 2]}
"""


@pytest.mark.slow
def test_ray_backend_gives_the_rows_of_local_workers(tmp_path):
    (tmp_path / "spec.yaml").write_text(SPEC)
    for name in ("local", "ray"):
        init_campaign(tmp_path / name, tmp_path / "spec.yaml")
    local = run_campaign(tmp_path / "local", workers=2)
    assert not ray.is_initialized()
    remote = run_campaign(tmp_path / "ray", workers=2, ray_address="local")
    assert not ray.is_initialized()  # the private cluster this run started is shut down again
    assert remote == local and local["done"] == 8
    a, b = campaign_tables(tmp_path / "local"), campaign_tables(tmp_path / "ray")
    assert len(a["trials"]) == 8 and len(a["baseline"]) == 2
    assert a == b


def test_ray_address_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"ray_address='' must be a non-empty str.*'local'"):
        run_campaign(tmp_path, ray_address="")
