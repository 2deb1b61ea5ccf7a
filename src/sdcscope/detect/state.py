"""Memory corruption of weights and optimizer state, caught bit-exactly and named to the element.

:meth:`StateChecksum.record` remembers, for every block of ``BLOCK`` stored 32-bit words of each
parameter and optimizer-state tensor (a block never straddles two tensors), two sums mod 2^32:
the plain sum of the words and a mixed sum Σ wᵢ·aᵢ + (wᵢ >> 16)·bᵢ with fixed odd random
multipliers (:func:`block_sums`). The shifted term brings a word's high half down, so a flip of
any bit k changes the mixed sum by an odd multiple of 2^(k mod 16): no bit is invisible. Flips of
one bit in many elements, 0→1 in some and 1→0 in others (which cancel in a plain sum), go unseen
only if random multipliers cancel (odds about 2^-17 or less per block). One corrupted word in a
block is named exactly: the plain delta gives its old bits, and only its position's multipliers
explain the mixed delta; several corrupted words in a block are named by the block's element
range (the guard names them one by one against a snapshot that holds the recorded state).

:meth:`StateChecksum.verify` recomputes the sums (a few vectorized passes, one host sync) and
names what changed although nothing legitimate wrote it. The guard verifies right before the
update (after the last micro-batch's backward), so faults that land at any moment since the
last record -- between steps, between micro-batches, during backward -- are caught before an
update builds on them, and records only state it verified (see :mod:`sdcscope.guard.session`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sdcscope.common.validate import check_bool, check_positive
from sdcscope.common.world import local
from sdcscope.detect.events import Event

BLOCK = 256
"""32-bit words per checksum block: the granularity a multi-word corruption is named at. Blocks
never straddle two tensors (small tensors summed together are padded to whole blocks)."""
CHUNK_ROWS = 4096
"""Blocks summed per pass of a large tensor (bounds the temporaries to 4 MiB)."""
GROUP_WORDS = 1 << 16
"""Tensors smaller than this are concatenated by device and summed together."""
MAX_NAMED = 16
"""Elements listed per event."""
_gen = torch.Generator().manual_seed(0x5DC)
_CPU_MULT = (torch.randint(0, 1 << 30, (2, BLOCK), generator=_gen, dtype=torch.int32) * 2 + 1).contiguous()
_MULT: dict[torch.device, torch.Tensor] = {}


def _mult(device: torch.device) -> torch.Tensor:
    m = _MULT.get(device)
    if m is None:
        m = _MULT[device] = _CPU_MULT.to(device)
    return m


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(device: torch.device) -> torch.Tensor:
    z = _ZEROS.get(device)
    if z is None:
        z = _ZEROS[device] = torch.zeros(BLOCK, dtype=torch.int32, device=device)
    return z


def words_of(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of ``t`` as a flat tensor of int32 words (zero-padded to a whole word)."""
    t = local(t).detach().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    nbytes = t.numel() * t.element_size()
    if nbytes % 4 == 0:
        try:
            return t.view(torch.uint8).view(torch.int32) if t.element_size() < 4 else t.view(torch.int32)
        except RuntimeError:  # a view at a storage offset that is no whole word: read a copy
            return t.clone().view(torch.uint8).view(torch.int32)
    raw = t.view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(4 - nbytes % 4)]).view(torch.int32)


def _lanes(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """The two sums of ``rows`` (``[blocks, k]`` or one ``[k]`` block): on CPU as integer GEMVs,
    which wrap mod 2^32 like the elementwise form and need no temporary of the words' size (the
    shifted words go to ``scratch``); elsewhere (no integer GEMV on accelerators) elementwise."""
    plain = rows.sum(-1, dtype=torch.int32)
    if rows.device.type == "cpu":
        hi = torch.empty_like(rows) if scratch is None else scratch[: rows.numel()].view(rows.shape)
        torch.bitwise_right_shift(rows, 16, out=hi)
        mixed = torch.mv(rows, a).add_(torch.mv(hi, b)) if rows.dim() == 2 else rows @ a + hi @ b
    else:
        mixed = _mixed_terms(rows, a, b).sum(-1, dtype=torch.int32)
    return torch.stack([plain, mixed], -1)


def _mixed_terms(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mixed = rows >> 16
    mixed.mul_(b)
    return mixed.add_(rows * a)


def block_sums(words: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[ceil(n / BLOCK), 2]`` int32 (arithmetic mod 2^32): each block's plain word sum and its
    mixed sum Σ wᵢ·aᵢ + (wᵢ >> 16)·bᵢ with odd random multipliers aᵢ, bᵢ. The shifted term brings
    the high half-word down: a flip of bit k changes the mixed sum by 2^(k mod 16)·(odd), so no
    bit is invisible, and flips in many elements cancel only if random multipliers do.
    ``scratch``: int32 room for ``min(n, CHUNK_ROWS * BLOCK)`` words, reused between calls."""
    n = words.numel()
    full = n // BLOCK
    m = _mult(words.device)
    parts = []
    if full:
        main = words[: full * BLOCK].view(full, BLOCK)
        parts += [_lanes(main[r : r + CHUNK_ROWS], m[0], m[1], scratch) for r in range(0, full, CHUNK_ROWS)]
    if n > full * BLOCK:
        r = n - full * BLOCK
        parts.append(_lanes(words[full * BLOCK :], m[0, :r], m[1, :r], scratch).view(1, 2))
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int32, device=words.device)


def _mixed(old: torch.Tensor, new: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (new - old) * a + ((new >> 16) - (old >> 16)) * b


@dataclass(kw_only=True)
class StateChecksumConfig:
    every: int = 1
    """Verify on steps with ``step % every == 0`` (right before their update)."""
    optimizer_state: bool = True

    def __post_init__(self) -> None:
        check_positive("state checksum every", self.every)
        check_bool("state checksum optimizer_state", self.optimizer_state)


@dataclass
class _Segment:
    """Tensors summed as one word sequence: ``parts`` = (tensor index, first word, words)."""

    parts: list[tuple[int, int, int]] = field(default_factory=list)
    words: int = 0


class StateChecksum:
    """``record()`` after the optimizer step; ``verify(step)`` before the next update → events."""

    name = "state_checksum"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: StateChecksumConfig | None = None,
        *,
        rank: int | None = None,
    ) -> None:
        self.config = config or StateChecksumConfig()
        self.model, self.optimizer, self.rank = model, optimizer, rank
        self._key: list[tuple] | None = None
        self._sums: torch.Tensor | None = None  # [blocks, 2] int32
        self._layout_of: tuple[list[tuple], list[_Segment]] | None = None
        self._scratch: torch.Tensor | None = None  # the shifted words of one chunk (CPU)
        self._plan: tuple[list, list] | None = None  # the segments' word views (see _words)
        self.recorded = False

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors, seen = [], [], set()
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            names.append(name)
            tensors.append(p)
            if self.optimizer is not None and self.config.optimizer_state:
                for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        names.append(f"{name}:{key}")
                        tensors.append(value)
        return names, tensors

    def _layout(self, tensors: list[torch.Tensor]) -> list[_Segment]:
        """Large tensors alone, small ones grouped by device, in tensor order."""
        segments, groups = [], {}
        for i, t in enumerate(tensors):
            n = -(-local(t).numel() * t.element_size() // 4)
            device = local(t).device
            if n >= GROUP_WORDS:
                segments.append(_Segment([(i, 0, n)], n))
                continue
            seg = groups.get(device)
            if seg is None:
                seg = groups[device] = _Segment()
                segments.append(seg)
            seg.parts.append((i, seg.words, n))
            seg.words += -(-n // BLOCK) * BLOCK  # the next tensor starts a block of its own
        return segments

    def _state(self) -> tuple[list[tuple], list[str], list[torch.Tensor], list[_Segment], torch.Tensor]:
        names, tensors = self._tensors()
        key = [(n, tuple(t.shape), t.dtype) for n, t in zip(names, tensors)]
        if self._layout_of is None or self._layout_of[0] != key:  # the layout follows the key
            self._layout_of = (key, self._layout(tensors))
            self._plan = None
        segments = self._layout_of[1]
        sums = []
        for words in self._words(segments, tensors):
            scratch = None
            if words.device.type == "cpu":
                need = min(words.numel(), CHUNK_ROWS * BLOCK)
                if self._scratch is None or self._scratch.numel() < need:
                    self._scratch = torch.empty(need, dtype=torch.int32)
                scratch = self._scratch
            sums.append(block_sums(words, scratch))
        device = sums[0].device if sums else torch.device("cpu")
        total = torch.cat([s.to(device) for s in sums]) if sums else torch.zeros(0, 2, dtype=torch.int32)
        return key, names, tensors, segments, total

    def _words(self, segments: list[_Segment], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each segment's words. Views of the tensors and, for a group of small tensors, a buffer
        they are copied into (one foreach copy) are kept while every tensor stays where it is in
        memory: no per-tensor work per call. A tensor that is no contiguous word sequence (a
        non-contiguous or odd-sized one) is read afresh each time (:meth:`_flat`)."""
        where = [(local(t).data_ptr(), local(t).is_contiguous()) for t in tensors]
        if self._plan is None or self._plan[0] != where:
            self._plan = (where, [self._plan_segment(seg, tensors) for seg in segments])
        out = []
        for seg, plan in zip(segments, self._plan[1]):
            if plan is None:
                out.append(self._flat(seg, tensors))
            elif isinstance(plan, torch.Tensor):
                out.append(plan)
            else:
                buffer, dst, src = plan
                torch._foreach_copy_(dst, src)
                out.append(buffer)
        return out

    @staticmethod
    def _plan_segment(seg: _Segment, tensors: list[torch.Tensor]):
        """A large tensor's word view; a group's (buffer, its parts' byte views, the tensors' byte
        views); None where a tensor must be read afresh."""
        if len(seg.parts) == 1:
            t = local(tensors[seg.parts[0][0]])
            w = words_of(t)
            return w if t.is_contiguous() and w.data_ptr() == t.data_ptr() else None
        srcs = []
        for i, _, _ in seg.parts:
            t = local(tensors[i]).detach()
            if not t.is_contiguous():
                return None
            srcs.append(t.reshape(-1).view(torch.uint8))
        device = local(tensors[seg.parts[0][0]]).device
        buffer = torch.zeros(-(-seg.words // BLOCK) * BLOCK, dtype=torch.int32, device=device)
        raw = buffer.view(torch.uint8)
        dsts = [raw[4 * first : 4 * first + src.numel()] for (_, first, _), src in zip(seg.parts, srcs)]
        return buffer, dsts, srcs

    @staticmethod
    def _flat(seg: _Segment, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The segment's words read afresh: one tensor's own, or several, each zero-padded to whole blocks."""
        if len(seg.parts) == 1:
            return words_of(tensors[seg.parts[0][0]])
        pieces = []
        for i, _, n in seg.parts:
            w = words_of(tensors[i])
            pieces.append(w)
            if n % BLOCK:
                pieces.append(_zeros(w.device)[: BLOCK - n % BLOCK])
        return torch.cat(pieces)

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def record(self) -> None:
        """Remember the state as it is now (call only on verified state: after an update of
        verified state, or a restore of a verified snapshot)."""
        self._key, _, _, _, self._sums = self._state()
        self.recorded = True

    def forget(self) -> None:
        self._sums = None
        self.recorded = False

    def verify(self, step: int) -> list[Event] | None:
        """Events for every tensor whose stored bits changed since :meth:`record`; None when there
        is nothing to compare with (no record yet, or the set of tensors changed: the first Adam
        step creates its state)."""
        if self._sums is None:
            return None
        key, names, tensors, segments, sums = self._state()
        if key != self._key:
            return None
        bad = (sums != self._sums).any(1).nonzero().flatten().tolist()  # the one host sync
        if not bad:
            return []
        return self._name(step, bad, names, tensors, segments, sums)

    def _name(self, step, bad, names, tensors, segments, sums) -> list[Event]:
        """Localize the differing blocks ``bad`` to tensors and elements (only on a finding)."""
        delta = sums[bad] - self._sums[bad]  # mod 2^32
        starts, first = [], 0
        for seg in segments:
            starts.append(first)
            first += -(-seg.words // BLOCK)
        found: dict[int, dict] = {}
        flats: dict[int, torch.Tensor] = {}
        for k, b in enumerate(bad):
            s = max(j for j, st in enumerate(starts) if st <= b)
            seg, w0 = segments[s], (b - starts[s]) * BLOCK
            if s not in flats:
                flats[s] = self._flat(seg, tensors)
            now = flats[s][w0 : w0 + BLOCK]
            m = _mult(now.device)[:, : now.numel()]
            d0, d1 = delta[k, 0], delta[k, 1]
            match = (_mixed(now - d0, now, m[0], m[1]) == d1) & (d0 != 0)
            hits = match.nonzero().flatten().tolist()
            single = w0 + hits[0] if len(hits) == 1 else None
            for i, off, n in seg.parts:
                lo, hi = max(w0, off), min(w0 + now.numel(), off + n)
                if lo >= hi or (single is not None and not lo <= single < hi):
                    continue
                info = found.setdefault(i, {"elements": [], "blocks": [], "bits": set(), "value": {}})
                es = tensors[i].element_size()
                if single is not None:
                    new = int(now[single - w0])
                    self._one_word(info, tensors[i], single - off, (new - int(d0)) & 0xFFFFFFFF, new & 0xFFFFFFFF)
                else:
                    numel = local(tensors[i]).numel()
                    info["blocks"].append([4 * (lo - off) // es, min(numel, -(-4 * (hi - off) // es))])
        events = []
        for i, info in found.items():
            t = tensors[i]
            elements = sorted(set(info["elements"]))
            named = bool(elements) and not info["blocks"]
            evidence = {
                "tensor": names[i],
                "elements": elements[:MAX_NAMED],
                "bits": sorted(info["bits"]),
            }
            if info["blocks"]:
                evidence["block"] = info["blocks"][0]
                evidence["blocks"] = info["blocks"][:MAX_NAMED]
                evidence["note"] = "several words changed in one block: the element range is named"
            if named and len(elements) == 1:
                evidence.update(info["value"])
            index = (
                tuple(int(x) for x in torch.unravel_index(torch.tensor(elements[0]), local(t).shape))
                if named and len(elements) == 1 and t.dim()
                else None
            )
            events.append(
                Event(
                    step,
                    self.name,
                    "corrupt",
                    module=names[i].split(":")[0],
                    rank=self.rank,
                    index=index,
                    evidence=evidence,
                )
            )
        return events

    def _one_word(self, info: dict, t: torch.Tensor, word: int, old: int, new: int) -> None:
        """Name the corrupted word ``word`` of ``t`` (stored bits ``old`` → ``new``): the elements
        and bits it holds that changed, and the value before and now of the first."""
        flat = local(t).detach().reshape(-1)
        es = flat.element_size()
        flipped = old ^ new
        elements = []
        for b in range(32):
            if flipped >> b & 1:
                byte = 4 * word + b // 8
                if byte // es < flat.numel():
                    elements.append(byte // es)
                    info["bits"].add((byte % es) * 8 + b % 8)
        info["elements"] += elements
        if not elements or info["value"]:
            return
        e = elements[0]
        raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.view(torch.uint8)
        before = raw[e * es : (e + 1) * es].clone().cpu()
        for j in range(es):
            byte = e * es + j
            if 4 * word <= byte < 4 * word + 4:
                before[j] = (old >> (8 * (byte - 4 * word))) & 0xFF
        view = flat.dtype if flat.dtype != torch.bool else torch.uint8
        info["value"] = {"value_before": before.view(view).item(), "value_now": flat[e].item()}
