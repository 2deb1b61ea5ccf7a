"""Precision-aware ABFT: bf16/fp16 results checked by tiles against the fp32 accumulator, with the
output rounding bounded per element (|round(y) − y| ≤ u·|y|), not widened by the threshold's c."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from helpers import on_grad_weight
from sdcscope.detect import ABFTConfig, ABFTDetector

U_BF16 = 2.0**-8
TILE = 8


def model_and_batch(batch: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 16))
    return model, torch.randn(batch, 16, 24)


def tile_bound(c: torch.Tensor, row: int, col: int) -> float:
    """The stated bound of a change of element (row, col): 2u(1+2u)·Σ|ĉ| over its tile -- the
    threshold's u·Σ|ĉ| plus as much again for the other elements' rounding, which may cancel part
    of the change (+ the fp32 part of the threshold, which the 1 % margin covers many times over)."""
    r0, c0 = row // TILE * TILE, col // TILE * TILE
    tile = c[r0 : r0 + TILE, c0 : c0 + TILE].float()
    return 1.01 * 2 * U_BF16 * (1 + 2 * U_BF16) * float(tile.abs().sum()) + 1e-30


def flip_bf16(value: torch.Tensor, bit: int) -> torch.Tensor:
    """``value`` (a bf16-exact number) with bf16 bit ``bit`` flipped, as the same dtype."""
    b = value.to(torch.bfloat16).view(torch.int16)
    return (b ^ torch.tensor(1 << bit, dtype=torch.int16)).view(torch.bfloat16).to(value.dtype)


def run_flips(gemm: str, tile: int | None, steps: int = 14, batch: int = 2):
    """One bf16 exponent flip (bits 7–13, in turn) per step in layer 0's Y or dW under autocast:
    [(|change|, stated bound, caught naming the tile, the event's tile, caught)]."""
    model, x = model_and_batch(batch)
    rng = random.Random(1)
    plan: dict = {}

    def corrupt(c: torch.Tensor) -> torch.Tensor:
        c2 = c.detach().reshape(-1, c.shape[-1])
        row, col = rng.randrange(c2.shape[0]), rng.randrange(c2.shape[1])
        before = c2[row, col].clone()
        c2[row, col] = flip_bf16(before, plan["bit"])
        plan.update(row=row, col=col, delta=float((c2[row, col].float() - before.float()).abs()))
        plan["bound"] = tile_bound(c2, row, col)
        return c

    if gemm == "forward":
        model[0].register_forward_hook(lambda m, a, out: corrupt(out.clone()) if plan.get("bit") is not None else None)
    else:
        on_grad_weight(model[0], lambda g: corrupt(g.clone()) if plan.get("bit") is not None else g)
    det = ABFTDetector(model, ABFTConfig(gemms=(gemm,), tile=tile, kinds=["linear"])).attach()
    results = []
    for step in range(steps + 1):
        plan.clear()
        plan["bit"] = None if step == 0 else 7 + step % 7
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        events = det.check(step)
        if step == 0:
            assert events == []  # clean
            continue
        mine = [e for e in events if e.module == "0" and e.gemm == gemm]
        want = (
            (plan["row"] // 16, plan["row"] % 16 // TILE * TILE) if gemm == "forward" else (plan["row"] // TILE * TILE,)
        )
        named = bool(mine) and tuple(mine[0].index[: len(want)]) == want
        results.append((plan["delta"], plan["bound"], named, mine and mine[0].evidence.get("tile"), bool(mine)))
        assert [e for e in events if e.module != "0"] == []
    return results


@pytest.mark.parametrize("gemm", ["forward", "grad_weight"])
def test_bf16_exponent_flips_beyond_the_tile_bound_are_caught_in_their_step(gemm):
    results = run_flips(gemm, TILE)
    beyond = [r for r in results if r[0] > r[1]]
    assert all(r[2] and r[3] == [TILE, TILE] for r in beyond), [r for r in beyond if not r[2]]
    assert len(beyond) >= 0.6 * len(results)  # most flips of bits 7-13 change a value by more


def test_tiles_catch_what_column_checksums_with_a_widened_threshold_miss():
    tiles = sum(r[4] for r in run_flips("forward", TILE, batch=8))
    columns = sum(r[4] for r in run_flips("forward", None, batch=8))  # each column sums 128 rows
    assert tiles >= 3 * max(columns, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clean_low_precision_training_raises_nothing(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    det = ABFTDetector(model, ABFTConfig()).attach()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(torch.randn(3, 20, 16) * 10 ** (step - 3))  # tiny to large, fp16 subnormals
        out.float().pow(2).mean().backward()
        assert det.check(step) == []
        opt.step()
    assert det.checks_run == 6 * 8  # Y of 3 layers, dX of 2 (the input needs none), dW of 3
