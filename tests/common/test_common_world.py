"""The world factory and the one support table: one process is a ``single`` world; what a world
cannot run is refused when the user set it and switched off when it is only the default."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from sdcscope.common.world import KINDS, SUPPORT, World, support_table, unsupported, world_of
from sdcscope.guard import GuardConfig
from sdcscope.guard.world import SECTIONS, fit_config


def test_a_plain_module_lives_in_a_single_process_world():
    world = world_of(nn.Linear(3, 2))
    assert (world.kind, world.rank, world.size, world.distributed, world.sharded) == ("single", 0, 1, False, False)
    assert world_of(nn.Linear(3, 2), rank=4).rank == 4
    with pytest.raises(TypeError, match="DistributedDataParallel.*Linear"):
        world_of(nn.Linear(3, 2), ddp=nn.Linear(3, 2))


def test_one_world_speaks_for_every_parameter_and_sums_its_own_norm():
    params = [torch.ones(3), torch.ones(2)]
    world = World()
    assert world.replica_weights(params).tolist() == [1.0, 1.0]
    sq = torch.tensor([4.0, 9.0])
    assert world.global_sq_norm(sq, params, [0, 1]) == 13.0
    assert World("ddp", 1, 4, degrees={"dp": 4}).dp_size == 4 and not World().tp_enabled


def test_the_support_table_names_a_reason_for_every_refusal_and_only_known_worlds():
    for feature, row in SUPPORT.items():
        assert set(row) <= set(KINDS), feature
        assert all(isinstance(why, str) and len(why) > 20 for why in row.values()), feature
    rows = dict(support_table())
    assert rows["guard.metrics"]["single"] == "yes" and rows["guard.metrics"]["sharded"] != "yes"
    assert unsupported("guard.invariants", "ddp") and unsupported("guard.invariants", "single") is None


@pytest.mark.parametrize("kind", ["ddp", "sharded"])
def test_a_section_the_user_set_is_refused_where_the_world_cannot_run_it(kind):
    for name in SECTIONS:
        if unsupported(f"guard.{name}", kind) is None:
            continue
        value = {
            "metrics": {"stats_every": 2},
            "zclip": {},
            "qk_clip": 50.0,
            "invariants": None,
            "collectives": {"reduce_scatter": False},
        }[name]
        if value is None:
            continue  # an invariants file must exist: checked by the DDP job tests
        with pytest.raises(ValueError, match=f"guard {name} is not supported in a {kind} run"):
            fit_config(GuardConfig.from_dict({name: value}), kind)


def test_a_default_section_the_world_cannot_run_is_switched_off_with_a_line(caplog):
    with caplog.at_level(logging.INFO, logger="sdcscope.guard.world"):
        fitted = fit_config(GuardConfig(), "sharded")
    assert fitted.metrics is None and fitted.abft == GuardConfig().abft
    assert "guard metrics is off in a sharded run" in caplog.text
    # one process runs no collective: the default collective checks are off, all else stays
    assert fit_config(GuardConfig(), "single") == dataclasses.replace(GuardConfig(), collectives=None)
    assert fit_config(GuardConfig(), "sharded").collectives == GuardConfig().collectives
    with pytest.raises(ValueError, match="ranks: null cannot watch a ddp run"):
        fit_config(GuardConfig(ranks=None), "ddp")
