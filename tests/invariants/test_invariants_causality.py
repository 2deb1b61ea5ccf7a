"""The causality probe and the ``Causal`` relation: a sequence model's outputs before position t do
not depend on its inputs from t on; causal-mask bugs break it, non-causal models never get it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdcscope.invariants import (
    Invariant,
    InvariantChecker,
    TraceConfig,
    TraceRecorder,
    check_trace,
    infer_invariants,
)
from sdcscope.invariants.probe import running
from sdcscope.invariants.relations import RELATIONS
from sdcscope.invariants.relations.causal import CHECK_EVERY, LEAK_TOL
from sdcscope.invariants.spec import Precondition
from sdcscope.invariants.traceconfig import CAUSAL_EVERY
from sdcscope.workloads import GPT, GPTConfig

VOCAB, T = 32, 12


def gpt(seed: int = 0, mask: str = "causal", dropout: float = 0.1) -> GPT:
    """A tiny GPT; ``mask`` breaks its attention mask the way real bugs do."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=16, vocab_size=VOCAB, dropout=dropout))
    for block in model.blocks:
        m = block.attn.causal_mask
        if mask == "ones":  # torch.ones instead of torch.tril: a bidirectional encoder
            m.fill_(True)
        elif mask == "off_by_one":  # tril(diagonal=1): each position sees the next one
            m.copy_(torch.tril(torch.ones_like(m), diagonal=1))
        elif mask == "transposed":  # the mask applied along the wrong axis
            m.copy_(m.T.clone())
    return model


def batch(seed: int, step: int, b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randint(0, VOCAB, (b, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model: nn.Module, tool, seed: int = 0, steps: int = 6, lr: float = 1e-2):
    """A plain loop; ``tool(model, opt)`` is a recorder or checker factory (or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t = tool(model, opt).attach() if tool is not None else None
    for step in range(steps):
        if t is not None:
            t.step_begin(step)
        x, y = batch(seed, step)
        opt.zero_grad()
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        if t is not None:
            t.step_end()
    if t is not None:
        t.detach()
    return t


def recorder(out=None, every: int = 2):
    return lambda model, opt: TraceRecorder(model, opt, out=out, config=TraceConfig(causal_probe=every))


def probed(rec_dir) -> dict[int, dict]:
    from sdcscope.invariants import load_trace

    out = {}
    for r in load_trace(rec_dir).phase("train"):
        for api, f in r["calls"]:
            if api == "forward" and "causal_leak" in f:
                out[r["step"]] = f
    return out


def test_config_validates_the_probe_interval():
    assert TraceConfig().causal_probe == CAUSAL_EVERY > 0
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="causal_probe"):
            TraceConfig(causal_probe=bad)


def test_probe_runs_on_the_first_step_then_every_n_and_a_causal_model_leaks_nothing(tmp_path):
    train(gpt(), recorder(tmp_path / "r", every=3), steps=7)
    got = probed(tmp_path / "r")
    assert sorted(got) == [0, 3, 6]
    for f in got.values():
        assert f["causal_leak"] == 0.0 and f["causal_len"] == T and f["causal_cut"] in (1, T // 2)


@pytest.mark.parametrize("mask", ["ones", "off_by_one", "transposed"])
def test_causal_mask_bugs_leak(tmp_path, mask):
    train(gpt(mask=mask), recorder(tmp_path / "r"), steps=1)
    (f,) = probed(tmp_path / "r").values()
    assert f["causal_leak"] > 10 * LEAK_TOL  # ~3e-2 at init (small attention branches), grows in training
    assert 0 <= f["causal_pos"] < f["causal_cut"] < T


def test_learned_from_causal_references_and_a_mask_bug_is_reported(tmp_path):
    refs = [tmp_path / f"ref{s}" for s in (1, 2)]
    for s, out in zip((1, 2), refs):
        train(gpt(s), recorder(out), seed=s)
    invs = {i.relation: i for i in infer_invariants(refs)}
    inv = invs["Causal"]
    assert inv.params == {"tolerance": LEAK_TOL, "every": CHECK_EVERY} and inv.support == 6

    def checker(model, opt):
        return InvariantChecker(model, opt, [inv], every_step=True)

    assert train(gpt(7), checker, seed=7).violations == []
    # The checker probes only for a Causal invariant.
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    assert InvariantChecker(model, opt, []).recorder.config.causal_probe == 0
    assert InvariantChecker(model, opt, [inv]).recorder.config.causal_probe == CHECK_EVERY
    inv.params["every"] = 4  # the YAML may ask for more probes
    events = train(gpt(7, mask="ones"), checker, seed=7, steps=9).violations
    assert [e["step"] for e in events] == [0, 4, 8]
    e = events[0]
    assert e["verdict"] == "causal.train.forward" and e["module"] == "GPT"
    ev = e["evidence"]
    assert ev["relation"] == "Causal" and ev["leak_ratio"] > LEAK_TOL and ev["seq_len"] == T
    assert 0 <= ev["position"] < ev["cut"] and "position" in ev["meaning"]
    # Offline, over a recorded trace, the same verdict.
    train(gpt(7, mask="off_by_one"), recorder(tmp_path / "bad"), seed=7)
    assert {e["verdict"] for e in check_trace(tmp_path / "bad", [inv])} == {"causal.train.forward"}


def test_a_bidirectional_encoder_gets_no_causal_invariant(tmp_path):
    refs = [tmp_path / f"ref{s}" for s in (1, 2)]
    for s, out in zip((1, 2), refs):
        train(gpt(s, mask="ones"), recorder(out), seed=s)
    invs = infer_invariants(refs)
    assert "Causal" not in {i.relation for i in invs}
    assert not any("causal" in str(i.params) for i in invs)  # probe fields are not call fields


def test_traced_run_is_bitwise_identical_to_an_untraced_one():
    def final(tool):
        model = gpt(3, dropout=0.2)
        train(model, tool, seed=3, steps=4)
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    plain, rng_plain = final(None)
    traced, rng_traced = final(recorder(every=1))
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    assert torch.equal(rng_plain, rng_traced)


def test_probe_restores_every_modules_mode_and_is_recorded_once():
    model = gpt()
    model.blocks[0].mlp.dropout.eval()  # a mixed state, as a user may leave it
    modes = [m.training for m in model.modules()]
    seen = []
    model.register_forward_hook(lambda m, a, o: seen.append(running()))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    rec = TraceRecorder(model, opt, config=TraceConfig(causal_probe=1)).attach()
    other = TraceRecorder(model, opt, config=TraceConfig(causal_probe=1)).attach()  # a second tool
    rec.step_begin(0)
    other.step_begin(0)
    x, y = batch(0, 0)
    F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    (r,), (o,) = rec.step_end(), other.step_end()
    rec.detach(), other.detach()
    assert [m.training for m in model.modules()] == modes
    assert seen == [False, True, True]  # each recorder's probe ran once; neither saw the other's
    for record in (r, o):
        forwards = [f for api, f in record["calls"] if api == "forward"]
        assert len(forwards) == 1 and forwards[0]["causal_leak"] == 0.0
        assert forwards[0]["target_shift"] == 1  # the probe's forwards did not disturb it


class Tagger(nn.Module):
    """Token ids in, (per-position logits, loss) out; extra arguments sliced with the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx, targets, *, scale: float = 1.0):
        logits = self.head(self.rnn(self.emb(idx))[0]) * scale
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        return self.head(self.emb(idx))


def _one_step(model, *args, **kwargs) -> dict:
    opt = torch.optim.SGD(model.parameters(), 0.1)
    rec = TraceRecorder(model, opt, config=TraceConfig(causal_probe=1)).attach()
    rec.step_begin(0)
    out = model(*args, **kwargs)
    out = out["logits"] if isinstance(out, dict) else out
    loss = out[1] if isinstance(out, tuple) else out.float().pow(2).mean()
    loss.backward()
    opt.step()
    (r,) = rec.step_end()
    rec.detach()
    return next(f for api, f in r["calls"] if api == "forward")


def test_probe_passes_extra_arguments_and_reads_tuple_outputs():
    x, y = batch(0, 0)
    f = _one_step(Tagger(), x, y, scale=2.0)
    assert f["causal_leak"] == 0.0 and f["target_shift"] == 1  # an RNN is causal


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: nn.Linear(T, 2), torch.randn(4, T)),  # floats
        (Classifier, torch.randint(0, VOCAB, (4, T))),  # no per-position output
        (lambda: nn.Embedding(VOCAB, 4), torch.randint(0, VOCAB, (4, 1))),  # T < 2
        (lambda: nn.Embedding(VOCAB, 4), torch.randint(0, VOCAB, (2, 3, T))),  # not 2-D
    ],
)
def test_no_probe_on_models_that_are_not_sequence_models(make, x):
    f = _one_step(make(), x)
    assert not any(k.startswith("causal") for k in f)


class Fragile(nn.Module):
    """Breaks on any batch but the one it was built for."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4)

    def forward(self, idx):
        if idx.shape[0] != 4:
            raise RuntimeError("expected a batch of 4")
        return self.emb(idx)


def test_a_probe_that_raises_is_disabled_with_a_warning_and_training_goes_on():
    with pytest.warns(RuntimeWarning, match="causality probe disabled.*expected a batch of 4"):
        f = _one_step(Fragile(), torch.randint(0, VOCAB, (4, T)))
    assert "causal_leak" not in f


def test_causal_invariant_params_are_validated():
    from sdcscope.invariants.relations import validate_invariant

    for bad in (
        {"tolerance": 0},
        {"tolerance": 1.5},
        {},
        {"tolerance": 1e-3, "x": 1},
        {"tolerance": 1e-3, "every": 0},
        {"tolerance": 1e-3, "every": True},
    ):
        with pytest.raises(ValueError, match="Causal"):
            validate_invariant(
                Invariant(id="c", relation="Causal", params=bad, precondition=Precondition(when=("forward",)))
            )
    assert "Causal" in RELATIONS


# -- models whose forward or train() has side effects, other input/output conventions ----------


class KwLM(nn.Module):
    """``forward(input_ids, attention_mask=None, labels=None) -> {"loss", "logits"}`` (HF style),
    causal; a step counter buffer the forward advances in any mode (a fake-quant observer)."""

    def __init__(self, loss_first: bool = True) -> None:
        super().__init__()
        self.loss_first = loss_first
        self.emb = nn.Embedding(VOCAB, 8)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, VOCAB)
        self.register_buffer("seen", torch.zeros(()))
        self.masks: list = []

    def forward(self, input_ids, attention_mask=None, labels=None):
        self.seen += 1
        if running():
            self.masks.append(attention_mask)
        h = self.rnn(self.emb(input_ids))[0]
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = self.head(h) * (1 + 1e-3 * self.seen)
        loss = None if labels is None else F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return {"loss": loss, "logits": logits} if self.loss_first else {"logits": logits, "loss": loss}


class LoRALinear(nn.Linear):
    """loralib style: ``eval()`` merges ``B @ A`` into the frozen weight, ``train()`` unmerges."""

    def __init__(self, i: int, o: int, r: int = 2) -> None:
        super().__init__(i, o)
        self.A = nn.Parameter(torch.randn(r, i) * 0.1)
        self.B = nn.Parameter(torch.randn(o, r) * 0.1)
        self.weight.requires_grad_(False)
        self.merged = False

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.merged:
            self.weight.data -= self.B @ self.A
            self.merged = False
        elif not mode and not self.merged:
            self.weight.data += self.B @ self.A
            self.merged = True
        return self

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y if self.merged else y + x @ self.A.t() @ self.B.t()


class LoraGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = gpt(dropout=0.0)
        self.gpt.head = LoRALinear(16, VOCAB)

    def forward(self, idx):
        return self.gpt(idx)


def _run(make, call, traced: bool, steps: int = 3):
    """``call(model, x, mask, y) -> loss``; the final parameters' digest, buffers, RNG state and
    the probes' fields."""
    from sdcscope.engine import param_sha256

    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = TraceRecorder(model, opt, config=TraceConfig(causal_probe=1)).attach() if traced else None
    found = []
    for step in range(steps):
        if rec:
            rec.step_begin(step)
        x, y = batch(0, step)
        mask = torch.ones_like(x)
        mask[:2, -3:] = 0
        opt.zero_grad()
        call(model, x, mask, y).backward()
        opt.step()
        if rec:
            found += [f for r in rec.step_end() for api, f in r["calls"] if api == "forward" and "causal_leak" in f]
    if rec:
        rec.detach()
    return (param_sha256(model), [b.clone() for b in model.buffers()], torch.get_rng_state()), found, model


def _same_as_untraced(make, call, steps: int = 3):
    (plain, *_), (traced, found, model) = _run(make, call, False, steps), _run(make, call, True, steps)
    assert plain[0] == traced[0]
    assert len(plain[1]) == len(traced[1]) and all(map(torch.equal, plain[1], traced[1]))
    assert torch.equal(plain[2], traced[2])
    assert len(found) == steps and all(f["causal_leak"] == 0.0 for f in found)
    return model


def _lm_loss(model, x, mask, y):
    out = model(x)
    return F.cross_entropy((out if isinstance(out, torch.Tensor) else out["logits"]).reshape(-1, VOCAB), y.reshape(-1))


def test_a_module_whose_eval_merges_weights_is_unmerged_and_trains_as_untraced():
    model = _same_as_untraced(LoraGPT, _lm_loss)
    head = model.gpt.head
    assert head.training and not head.merged
    assert head.A.grad is not None and head.A.grad.abs().sum() > 0


def test_buffers_the_forward_advances_are_put_back_in_place():
    model = _same_as_untraced(lambda: KwLM(loss_first=False), _lm_loss)
    assert model.seen.item() == 3  # the training forwards only
    # The same tensor, as references to it (an optimizer, a hook) expect.
    ref = model.seen
    _one_step(model, batch(0, 0)[0])
    assert model.seen is ref and ref.item() == 4


def test_replacement_ids_are_taken_from_the_same_column_of_the_batch():
    class Pairs(nn.Module):  # [B, 2] (user id, item id): separate vocabularies
        def __init__(self) -> None:
            super().__init__()
            self.u, self.i, self.head = nn.Embedding(1000, 4), nn.Embedding(20, 4), nn.Linear(8, 2)
            self.fed: list = []

        def forward(self, pair):
            if running():
                self.fed.append(pair.clone())
            return self.head(torch.cat([self.u(pair[:, 0]), self.i(pair[:, 1])], -1))

    model = Pairs()
    pair = torch.tensor([[500, 3], [7, 12], [999, 3], [250, 19]])  # row 0's item id: the column's min
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = _one_step(model, pair)
    assert "causal_leak" in f and f["causal_len"] == 2  # not causal: each output sees both ids
    (fed,) = model.fed
    for j in range(2):
        assert set(fed[:, j].tolist()) <= set(pair[:, j].tolist())
    assert fed[1:, 1].tolist() == [19]  # cut 1: the item id replaced by the column's max


@pytest.mark.parametrize("loss_first", [True, False])
def test_probe_runs_on_keyword_token_ids_and_picks_the_per_position_output(loss_first):
    def call(model, x, mask, y):
        return model(input_ids=x, attention_mask=mask, labels=y)["loss"]

    model = _same_as_untraced(lambda: KwLM(loss_first), call)
    mask = model.masks[0]  # the probe's attention mask: the first sequence's, one per probe row
    assert (
        mask.shape == (1 + len({1, T // 2}), T)
        and (mask == batch(0, 0)[0].new_ones(T).where(torch.arange(T) < T - 3, 0)).all()
    )


def test_dict_output_with_the_loss_first_is_probed_positionally():
    _same_as_untraced(lambda: KwLM(loss_first=True), lambda m, x, mask, y: m(x, mask, y)["loss"])


def test_a_batch_of_one_sequence_is_not_probed():
    f = _one_step(gpt(), batch(0, 0, b=1)[0])
    assert not any(k.startswith("causal") for k in f)
