"""The Guard in a real ``transformers.Trainer`` (a tiny Llama built from its config, on CPU):
a clean run is untouched, a transient GEMM fault is caught that step, named and recomputed (or
vetoed with the Adam state untouched), gradient accumulation is replayed whole, and bad configs
or unsupported settings fail before training."""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from helpers import event_summary, output_flip, random_flip, same, same_state  # noqa: E402
from sdcscope.common.io import read_jsonl  # noqa: E402
from sdcscope.detect import ABFTDetector  # noqa: E402
from sdcscope.faults import FaultSpec  # noqa: E402
from sdcscope.guard import GuardConfig  # noqa: E402
from sdcscope.inject import Injector  # noqa: E402
from sdcscope.integrations.hf import SDCGuardCallback, guard_trainer  # noqa: E402

STEPS, FAULT_STEP, CLIP = 6, 3, 0.5
TARGET = "model.layers.1.mlp.up_proj"


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Position(TrainerCallback):
    """Tells the injector which step and micro-batch the Trainer is at."""

    def __init__(self, injector: Injector) -> None:
        self.injector, self.micro = injector, 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.micro = 0
        self.injector.set_position(state.global_step, 0)

    def on_substep_end(self, args, state, control, **kwargs):
        self.micro += 1
        self.injector.set_position(state.global_step, self.micro)


def flip(micro_batch: int = 0, kind: str = "transient") -> FaultSpec:
    """Exponent bit 30 of one element of the MLP's up projection output: ~0.1 becomes ~1e37."""
    return output_flip(TARGET, FAULT_STEP, micro_batch, kind)


def llama():
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def make_trainer(tmp_path, *, build=llama, spec=None, accum=1, callbacks=(), evaluate=False, **args):
    torch.manual_seed(0)
    model = build()
    injector = Injector(model, [spec] if spec else []).attach()
    args = {"max_steps": STEPS, **({"eval_strategy": "steps", "eval_steps": 2} if evaluate else {}), **args}
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accum,
        learning_rate=1e-2,
        max_grad_norm=CLIP,
        logging_steps=1,
        seed=0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **args,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        eval_dataset=Tokens(8) if evaluate else None,
        callbacks=[Position(injector), *callbacks],
    )
    return trainer, injector


def train(tmp_path, config=None, *, guard=True, **kw):
    trainer, injector = make_trainer(tmp_path, **kw)
    full = GuardConfig(profile="full")  # every GEMM checked every step
    sdc = guard_trainer(trainer, full if config is None else config, run_dir=tmp_path / "sdc") if guard else None
    trainer.train()
    return trainer, sdc, injector


def params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    trainer, _, _ = train(tmp_path_factory.mktemp("clean"), guard=False)
    return params(trainer), losses(trainer)


class OwnStep(TrainerCallback):
    """The optimizer's ``step`` as training begins (the LR scheduler's own wrapper), before the guard's."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.step = vars(optimizer).get("step")


def test_clean_run_is_untouched_and_the_trainer_restored(tmp_path, clean):
    own = OwnStep()
    trainer, sdc, _ = train(tmp_path, callbacks=[own], evaluate=True)  # evaluation passes in between change nothing
    assert sdc.events == [] and (tmp_path / "sdc" / "events.jsonl").read_text() == ""
    assert same(params(trainer), clean[0]) and losses(trainer) == clean[1]  # bitwise: the guard only reads
    assert any("eval_loss" in h for h in trainer.state.log_history)
    rows = read_jsonl(tmp_path / "sdc" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert max(r["grad_norm"] for r in rows) > CLIP  # the guard saw the gradients before the Trainer clipped them
    # the attention metrics of Llama's SDPA calls, named by its attention modules
    assert all(0 < r["attn/max_logit_bound/model.layers.1.self_attn"] for r in rows)
    assert rows[0]["attn/max_logit"] <= rows[0]["attn/max_logit_bound"] and rows[0]["attn/entropy"] > 0
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    # detached at train end: no wrapper left on the trainer or optimizer, no hook on the model
    assert "training_step" not in vars(trainer) and vars(trainer.optimizer).get("step") is own.step
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainer.model.modules())


def test_transient_fault_is_caught_named_and_recomputed(tmp_path, clean):
    trainer, sdc, injector = train(tmp_path, spec=flip())
    assert [(r["step"], r["module"]) for r in injector.records] == [(FAULT_STEP, TARGET)]
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "transient", "recompute", TARGET)]
    (event,) = read_jsonl(tmp_path / "sdc" / "events.jsonl")
    assert event["gemm"] == "forward" and event["evidence"]["replay"]["verdict"] == "transient"
    # the clean re-execution replaced the corrupted step: parameters and the Trainer's logged
    # losses are the clean run's, bit for bit
    assert same(params(trainer), clean[0]) and losses(trainer) == clean[1]
    unguarded, _, _ = train(tmp_path / "unguarded", guard=False, spec=flip())
    assert not same(params(unguarded), clean[0])  # the fault does change an unguarded run


class Watch(TrainerCallback):
    """Parameters and Adam state (exp_avg, exp_avg_sq, step) when step ``s`` begins
    (``seen["begin", s]``) and after it (``seen["end", s]``)."""

    def __init__(self, *steps: int) -> None:
        self.steps, self.seen = steps, {}

    def _take(self, when, model, optimizer):
        self.seen[when] = (
            [p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in s.items()} for s in optimizer.optimizer.state.values()],
        )

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step in self.steps:
            self._take(("begin", state.global_step), model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step - 1 in self.steps:  # global_step counts the step just done
            self._take(("end", state.global_step - 1), model, optimizer)


def test_veto_leaves_parameters_and_adam_state_untouched(tmp_path):
    watch = Watch(FAULT_STEP, FAULT_STEP + 1)
    config = GuardConfig(profile="full", policy={"rules": {"abft:transient": ["veto"]}})
    trainer, sdc, _ = train(tmp_path, config, spec=flip(), callbacks=[watch])
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "transient", "veto", TARGET)]
    assert same_state(watch.seen["begin", FAULT_STEP], watch.seen["end", FAULT_STEP])
    assert not same(watch.seen["end", FAULT_STEP][0], watch.seen["end", FAULT_STEP + 1][0])  # then it trains on
    assert trainer.state.global_step == STEPS and sdc.guard.discarded_steps == 1


def test_weight_corruption_is_rolled_back(tmp_path):
    """A flipped weight between steps: the state checksums catch it before the forward pass and
    the model and optimizer go back to the latest snapshot (taken when step 2 began)."""
    watch = Watch(2, FAULT_STEP)
    spec = random_flip("weight", f"{TARGET}.weight", FAULT_STEP)
    trainer, sdc, _ = train(tmp_path, {"snapshots": {"every": 2}}, spec=spec, callbacks=[watch])
    assert event_summary(sdc.events) == [(FAULT_STEP, "state_checksum", "corrupt", "rollback", f"{TARGET}.weight")]
    assert same_state(watch.seen["begin", 2], watch.seen["end", FAULT_STEP])
    assert trainer.state.global_step == STEPS and trainer.model.get_submodule(TARGET).weight.abs().max() < 10


def test_gradient_accumulation_is_replayed_whole(tmp_path):
    reference, _, _ = train(tmp_path / "clean", guard=False, accum=2)
    trainer, sdc, injector = train(tmp_path, spec=flip(micro_batch=1), accum=2)
    assert [(r["step"], r["micro_batch"]) for r in injector.records] == [(FAULT_STEP, 1)]
    assert event_summary(sdc.events) == [(FAULT_STEP, "abft", "transient", "recompute", TARGET)]
    assert same(params(trainer), params(reference)) and losses(trainer) == losses(reference)


def test_guard_failure_is_an_event_not_a_crash(tmp_path, monkeypatch, clean):
    def broken(self, step=None):
        raise ZeroDivisionError("checksum unit on fire")

    monkeypatch.setattr(ABFTDetector, "check", broken)
    trainer, sdc, _ = train(tmp_path)
    assert trainer.state.global_step == STEPS and same(params(trainer), clean[0])
    assert {(e["detector"], e["verdict"]) for e in sdc.events} == {("guard", "internal_error")}
    assert "checksum unit on fire" in sdc.events[0]["evidence"]["error"]
    with pytest.raises(ZeroDivisionError):  # unless told to
        train(tmp_path / "strict", GuardConfig(profile="full", strict=True))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # step 0 vetoed
def test_a_stalled_guard_stops_training(tmp_path):
    """A permanent fault the replay reproduces: every step is vetoed; after stall_after of them
    the adapter ends training rather than spin."""
    trainer, sdc, _ = train(tmp_path, {"profile": "full", "stall_after": 2}, spec=flip(kind="permanent"))
    assert trainer.state.global_step == 2 and sdc.guard.discarded_steps == 2
    assert [e["verdict"] for e in sdc.events if e["detector"] == "guard"] == ["stalled"]
    assert {e["action"] for e in sdc.events if e["detector"] == "abft"} == {"veto"}


@pytest.mark.parametrize(
    "config, error, match",
    [
        ("abtf:\n  c: 4\n", ValueError, r"unknown guard config key 'abtf' \(did you mean 'abft'\?\)"),
        ("replay: yes-please\n", TypeError, "replay='yes-please' must be a boolean"),
        (None, FileNotFoundError, "does not exist"),
        (42, TypeError, "must be a GuardConfig, a YAML/JSON file path, a mapping or None, got int 42"),
    ],
)
def test_bad_config_fails_before_training(tmp_path, config, error, match):
    trainer, _ = make_trainer(tmp_path)
    if isinstance(config, str) or config is None:
        path = tmp_path / "guard.yaml"
        if config is not None:
            path.write_text(config)
        config = path
    with pytest.raises(error, match=match):
        guard_trainer(trainer, config)
    assert not any(isinstance(c, SDCGuardCallback) for c in trainer.callback_handler.callbacks)


def test_unsupported_settings_are_named(tmp_path):
    trainer, _ = make_trainer(tmp_path, torch_compile=True)
    with pytest.raises(ValueError, match="cannot guard this Trainer: torch_compile=True"):
        guard_trainer(trainer)
    with pytest.raises(TypeError, match="needs a transformers.Trainer, got Module"):
        guard_trainer(torch.nn.Module())


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))


@pytest.mark.parametrize("site", ["gemm.forward", "gemm.grad_weight"])
def test_gpt2_conv1d_faults_are_caught_and_recomputed(tmp_path, site):
    """GPT-2's projections are transformers Conv1D (W stored (in, out)): injected and checked too."""
    target = "transformer.h.0.mlp.c_fc"
    spec = FaultSpec(
        site=site,
        target=target,
        model="bitflip",
        bits=(30,),
        pattern={"kind": "element", "index": "random"},
        schedule={"kind": "transient", "step": 1},
        seed=1,
    )
    clean, _, _ = train(tmp_path / "clean", build=gpt2, max_steps=3)
    trainer, sdc, injector = train(tmp_path / "faulty", build=gpt2, max_steps=3, spec=spec)
    assert [(r["step"], r["module"]) for r in injector.records] == [(1, target)]
    abft = [(e["step"], e["module"], e["gemm"]) for e in sdc.events if e["detector"] == "abft"]
    assert abft == [(1, target, site.split(".")[1])]  # (the non-finite detector may see the flip too)
    assert {(e["step"], e["verdict"], e["action"]) for e in sdc.events} == {(1, "transient", "recompute")}
    assert same(params(trainer), params(clean))


def test_import_is_lazy_and_names_the_extra(monkeypatch):
    code = (
        "import sys, sdcscope.integrations; "
        "print(sorted({'transformers', 'accelerate', 'lightning', 'pytorch_lightning'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    monkeypatch.delitem(sys.modules, "sdcscope.integrations.hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'sdcscope\[transformers\]'"):
        import sdcscope.integrations.hf  # noqa: F401


def mixtral(experts: str):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=32,
            experts_implementation=experts,
        )
    )


def test_mixtral_experts_are_checked_per_expert_when_applied_with_f_linear(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, eager, _ = train(tmp_path / "eager", build=lambda: mixtral("eager"))
        _, grouped, _ = train(tmp_path / "grouped", build=lambda: mixtral("grouped_mm"))
    assert eager.events == [] and grouped.events == []
    checked = {name for name, _ in eager.guard.abft.max_ratio}
    assert {
        f"model.layers.{i}.mlp.experts.{w}[{e}]"
        for i in range(2)
        for w in ("gate_up_proj", "down_proj")
        for e in range(4)
    } <= checked and "model.layers.0.mlp.gate.weight" in checked
    assert max(eager.guard.abft.max_ratio.values()) < 1 and not eager.guard.abft.unreached
    # one grouped-GEMM kernel for every expert: not F.linear, so unchecked and said so
    assert "model.layers.0.mlp.experts.down_proj[0]" in grouped.guard.abft.unreached
    assert any("experts_implementation='eager'" in str(w.message) for w in caught)
