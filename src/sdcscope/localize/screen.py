"""Device screening: a short deterministic golden workload on each device, compared bit for bit.

:func:`screen_device` trains a small fixed model (two Linear layers and a batched product, fixed
seeded data, plain SGD) for ``steps`` steps on one device and digests every step: the sha256 of
the loss, the gradients and the parameters as stored bits. The same device type and software
stack (torch version, device name, dtype, CPU capability, threads) must give the same digests on
every healthy device; a **reference** (:class:`References`, a JSON file written by
``sdcscope screen --record``) holds them per stack. A device whose digests differ from the
reference is ``fail`` (the first differing step and what differed are named); one that differs
from itself when run twice is ``nondeterministic`` (the screen cannot judge it); one whose stack
has no reference is ``no_reference``. Results go to the device ledger
(:mod:`sdcscope.localize.ledger`): a failing device is marked faulty, a passing one is marked
healthy with the screen's record -- how an operator checks a suspect node before putting it back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdcscope.common.io import write_json
from sdcscope.common.validate import check_choice, check_positive
from sdcscope.faults import FaultSpec
from sdcscope.inject import Injector
from sdcscope.localize.history import History, screen_record
from sdcscope.localize.ledger import Ledger, device_id, device_identity, utc_now

REFERENCE_FORMAT = "sdcscope-screen/1"
WORKLOAD_VERSION = 1
"""Bump when the golden workload changes: references of another version never match."""
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class ScreenConfig:
    steps: int = 8
    batch: int = 64
    width: int = 256
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "width"):
            check_positive(f"screen {name}", getattr(self, name))
        check_choice("screen dtype", self.dtype, DTYPES)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"screen seed={self.seed!r} must be an integer >= 0")


class Golden(nn.Module):
    """The golden model: x → fc1 → GELU → (h·hᵀ)·h / width → fc2."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.fc1 = nn.Linear(64, width)
        self.fc2 = nn.Linear(width, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.fc1(x))
        h = h + torch.bmm(h.unsqueeze(0), h.unsqueeze(0).transpose(1, 2)).squeeze(0) @ h / h.shape[0]
        return self.fc2(h)


def visible_devices() -> list[str]:
    """Every device this process sees: ``cpu`` and each ``cuda:i``."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def stack_key(device: str, config: ScreenConfig) -> dict[str, Any]:
    """What a reference must share with a screen to be compared bit for bit."""
    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        extra = {"cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(dev))}
    else:
        name = "cpu"
        extra = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": 1}
    return {
        "workload": WORKLOAD_VERSION,
        "torch": torch.__version__.split("+")[0],
        "device_type": dev.type,
        "device_name": name,
        **extra,
        **asdict(config),
    }


def _key_text(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True)


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """One CPU thread (the reduction order of a CPU GEMM depends on the thread count) and no TF32."""
    threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else None
    try:
        if device.type == "cpu":
            torch.set_num_threads(1)
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
        yield
    finally:
        torch.set_num_threads(threads)
        if tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = tf32


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_golden(device: str, config: ScreenConfig, faults: Sequence[FaultSpec] = ()) -> list[dict[str, str]]:
    """The golden workload on ``device``: per step the sha256 of the loss, gradients and updated
    parameters. ``faults``: specs for the :class:`~sdcscope.inject.Injector` (a simulated bad device;
    targets ``fc1``, ``fc2``)."""
    dev = torch.device(device)
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), _deterministic(dev):
        torch.manual_seed(config.seed)
        model = Golden(config.width).to(dev, dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = torch.randn(config.steps, config.batch, 64, generator=gen).to(dev, dtype)
        target = torch.randn(config.steps, config.batch, 64, generator=gen).to(dev, dtype)
        injector = Injector(model, list(faults), opt, warn_unfired=False).attach() if faults else None
        digests = []
        try:
            for step in range(config.steps):
                if injector is not None:
                    injector.set_position(step, 0)
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(data[step]).float(), target[step].float())
                loss.backward()
                grads = [p.grad for p in model.parameters()]
                opt.step()
                digests.append(
                    {
                        "loss": _digest(loss),
                        "grads": _digest(*grads),
                        "params": _digest(*model.parameters()),
                    }
                )
        finally:
            if injector is not None:
                injector.detach()
    return digests


@dataclass
class ScreenResult:
    device: str  # as the ledger knows it (host:cuda:i, host:cpu:0)
    target: str  # as torch names it (cpu, cuda:0)
    verdict: str  # pass, fail, nondeterministic, no_reference, recorded
    key: dict[str, Any]
    first_difference: dict[str, Any] | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class References:
    """Golden digests per software stack, kept in a JSON file (``--reference``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
                if data.get("format") != REFERENCE_FORMAT:
                    raise ValueError(f"format {data.get('format')!r}, expected {REFERENCE_FORMAT!r}")
                self.entries = dict(data["references"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"screen reference {str(self.path)!r} is not readable: {exc}") from None

    def get(self, key: dict[str, Any]) -> list[dict[str, str]] | None:
        entry = self.entries.get(_key_text(key))
        return None if entry is None else entry["digests"]

    def put(self, key: dict[str, Any], digests: list[dict[str, str]], device: str) -> None:
        self.entries[_key_text(key)] = {
            "key": key,
            "digests": digests,
            "recorded_on": device,
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"format": REFERENCE_FORMAT, "references": self.entries})


def _first_difference(got: list[dict[str, str]], want: list[dict[str, str]]) -> dict[str, Any] | None:
    for step, (a, b) in enumerate(zip(got, want)):
        differs = [k for k in ("loss", "grads", "params") if a.get(k) != b.get(k)]
        if differs:
            return {"step": step, "differs": differs}
    return None if len(got) == len(want) else {"step": min(len(got), len(want)), "differs": ["steps"]}


def screen_device(
    target: str,
    references: References,
    config: ScreenConfig | None = None,
    *,
    record: bool = False,
    faults: Sequence[FaultSpec] = (),
) -> ScreenResult:
    """Screen one device (``cpu``, ``cuda:0``): run the golden workload twice and compare the
    runs with each other and with the reference of its stack (``record``: store the runs as the
    reference instead, when they agree)."""
    config = config or ScreenConfig()
    key = stack_key(target, config)
    t0 = time.perf_counter()
    first = run_golden(target, config, faults)
    second = run_golden(target, config, faults)
    seconds = round(time.perf_counter() - t0, 3)
    device = device_id(target)
    own = _first_difference(first, second)
    if own is not None:
        return ScreenResult(device, target, "nondeterministic", key, own, seconds)
    if record:
        references.put(key, first, device)
        return ScreenResult(device, target, "recorded", key, None, seconds)
    want = references.get(key)
    if want is None:
        return ScreenResult(device, target, "no_reference", key, None, seconds)
    diff = _first_difference(first, want)
    return ScreenResult(device, target, "fail" if diff else "pass", key, diff, seconds)


def screen(
    targets: Sequence[str] | None,
    reference: str | Path,
    ledger: str | Path | None,
    config: ScreenConfig | None = None,
    *,
    record: bool = False,
    faults: Sequence[FaultSpec] = (),
    history: str | Path | None = None,
) -> list[ScreenResult]:
    """Screen ``targets`` (default every visible device) against ``reference``; write the verdicts
    to the device ledger at ``ledger`` (failing: faulty; passing: healthy; others: noted only) and
    the passing and failing ones to the fleet history directory ``history``
    (:mod:`sdcscope.localize.history`), as one run."""
    refs = References(reference)
    results = [screen_device(t, refs, config, record=record, faults=faults) for t in targets or visible_devices()]
    if record:
        refs.save()
    when = utc_now()
    run = f"screen-{socket.gethostname()}-{when}"
    entries = {
        r.device: {"screen": r.verdict, "first_difference": r.first_difference, "key": r.key, "time": when, "run": run}
        | ({"injected": True} if faults else {})  # a simulated bad device: no evidence against it
        for r in results
    }
    if history is not None:
        found = [screen_record(r.device, entries[r.device], run, device_identity(r.device)) for r in results]
        History(history).append([x for x in found if x is not None])
    if ledger is not None:
        book = Ledger(ledger, entries=Ledger.read(ledger))
        for r in results:
            entry = entries[r.device]
            if r.verdict == "fail":
                where = r.first_difference or {}
                book.mark(
                    r.device, True, f"screen: golden step {where.get('step')} differs ({where.get('differs')})", **entry
                )
            elif r.verdict == "pass":
                book.mark(r.device, False, "screen: golden workload bitwise equal to the reference", **entry)
            else:
                book.mark(r.device, None, None, **entry)
    return results
