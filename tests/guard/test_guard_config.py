"""GuardConfig from dicts, read-only mappings and YAML files: defaults, type checks and errors that
name the key, section and value."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from sdcscope.guard.config import GuardConfig

NOT_MAPPINGS = [[], [1], "", "abc", 0, 5, 1.5, False, True, ("a",)]


@pytest.mark.parametrize("data", NOT_MAPPINGS, ids=repr)
def test_guard_config_from_dict_refuses_a_non_mapping(data):
    with pytest.raises(TypeError, match=r"guard config must be a mapping.*got") as info:
        GuardConfig.from_dict(data)
    assert repr(data) in str(info.value)


@pytest.mark.parametrize("data", [None, {}, MappingProxyType({})], ids=repr)
def test_guard_config_from_dict_none_or_empty_mapping_is_the_defaults(data):
    assert GuardConfig.from_dict(data) == GuardConfig()


def test_guard_config_from_dict_takes_any_mapping_and_nested_mappings():
    cfg = GuardConfig.from_dict(MappingProxyType({"replay": False, "abft": MappingProxyType({"budget": 0.05})}))
    assert cfg.replay is False and cfg.abft.budget == 0.05


@pytest.mark.parametrize(
    "section,value",
    [("abft", []), ("abft", "on"), ("metrics", 0), ("nonfinite", [1]), ("loss_spike", True), ("ranks", 3.0)],
)
def test_guard_config_refuses_a_non_mapping_section(section, value):
    with pytest.raises(TypeError, match=rf"guard {section} must be a mapping"):
        GuardConfig.from_dict({section: value})


@pytest.mark.parametrize("text", ["", "# only a comment\n", "null\n", "~\n", "{}\n"], ids=repr)
def test_guard_config_load_an_empty_file_is_the_defaults(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    assert GuardConfig.load(path) == GuardConfig()


@pytest.mark.parametrize("text", ["[]\n", "- abft\n", "5\n", "hello\n", "true\n", "'{}'\n"], ids=repr)
def test_guard_config_load_refuses_a_document_that_is_not_a_mapping(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"guard config '.*guard\.yaml' must hold a mapping"):
        GuardConfig.load(path)


# -- configs from any mapping (an OmegaConf/Hydra config, a MappingProxyType), nested too ---------
def test_guard_config_from_read_only_mappings():
    from types import MappingProxyType as RO

    from sdcscope.guard import GuardConfig

    cfg = GuardConfig.from_dict(
        RO(
            {
                "abft": RO({"c": 6.0, "kinds": ["linear"]}),
                "policy": RO({"rules": RO({"abft:transient": ["veto"]})}),
                "ranks": RO({"ledger": RO({})}),
            }
        )
    )
    assert cfg.abft.c == 6.0 and cfg.abft.kinds == ("linear",)
    assert cfg.policy.actions_for("abft", "transient") == ["veto"]
    with pytest.raises(ValueError, match="unknown abft key 'cc'"):
        GuardConfig.from_dict(RO({"abft": RO({"cc": 6.0})}))


def test_a_guard_config_reads_exponents_without_a_dot_as_numbers(tmp_path):
    (tmp_path / "g.yaml").write_text("abft: {budget: 2e-2}\nloss_spike: {alarm_z: 1e1}\n")
    config = GuardConfig.load(tmp_path / "g.yaml")
    assert config.abft.budget == 0.02 and config.loss_spike.alarm_z == 10.0


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"abft": {"c": -1}}, "c=-1"),
        ({"abtf": {}}, "did you mean 'abft'"),
        ({"policy": {"rules": {"abft:transient": ["explode"]}}}, "explode"),
        ({"snapshots": {"every": 0}}, "every"),
        ({"replay": "yes"}, "replay"),
    ],
)
def test_bad_guard_configs(data, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        GuardConfig.from_dict(data)


# -- E: config validation --------------------------------------------------------------------
@pytest.mark.parametrize(
    "data,needle",
    [
        ({"loss_spike": {"two_sided": "no"}}, "two_sided='no'.*allowed: true, false"),
        ({"grad_spike": {"log_space": "no"}}, "log_space='no'"),
        ({"state_checksum": {"optimizer_state": "no"}}, "optimizer_state='no'"),
        ({"nonfinite": {"check_grads": 1}}, "check_grads=1"),
        ({"metrics": {"cosines": "yes"}}, "cosines='yes'"),
        ({"ranks": {"quarantine": "off"}}, "quarantine='off'"),
        ({"qk_clip": True}, "qk_clip=True"),
        ({"strict": "false"}, "strict='false'"),
        ({"lr_backoff": {"factor": "half"}}, "factor='half'.*> 0.0 and < 1.0"),
        ({"lr_backoff": {"factor": True}}, "factor=True"),
        ({"lr_backoff": {"recover_steps": True}}, "recover_steps=True"),
        ({"zclip": {"alpha": "x"}}, "alpha='x'"),
        ({"zclip": {"z_threshold": "x"}}, "z_threshold='x'"),
        ({"zclip": {"max_grad_norm": -1}}, "max_grad_norm=-1.*> 0"),
        ({"loss_spike": {"alarm_z": True}}, "alarm_z=True"),
        ({"snapshots": {"keep": 2.0}}, "keep=2.0"),
        ({"policy": {"rules": {"abft:transient": 5}}}, "'abft:transient'.*5.*allowed: none, veto"),
        ({"policy": {"rules": {"abft:transient": None}}}, "'abft:transient'.*None"),
        ({"invariants": 5}, "invariants=5"),
    ],
)
def test_wrongly_typed_config_values_are_refused_by_name(data, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        GuardConfig.from_dict(data)


def test_config_booleans_and_numbers_accepted():
    c = GuardConfig.from_dict(
        {
            "loss_spike": {"two_sided": True, "alarm_z": 6},
            "qk_clip": 50,
            "state_checksum": {"optimizer_state": False},
            "policy": {"rules": {"abft:transient": ("recompute", "report")}},
        }
    )
    assert c.loss_spike.two_sided is True and c.qk_clip == 50 and c.state_checksum.optimizer_state is False
    assert c.policy.actions_for("abft", "transient") == ["recompute", "report"]


# -- 3. nested config errors name their section ----------------------------------------------------
@pytest.mark.parametrize(
    "data,needle",
    [
        ({"abft": {"c": -1}}, r"^guard abft: c=-1 must be a finite number > 0"),
        ({"abft": {"every": 0}}, r"^guard abft: every=0 must be a positive integer"),
        ({"abft": {"checksums": "diag"}}, r"^guard abft: unknown checksums 'diag'; allowed: both, row, column"),
        ({"loss_spike": {"window": 0}}, r"^guard loss_spike: window=0"),
        ({"grad_spike": {"window": 0}}, r"^guard grad_spike: window=0"),
        ({"metrics": {"stats_every": -1}}, r"^guard metrics: stats_every=-1"),
        ({"abft": {"chcksums": "both"}}, r"^unknown abft key 'chcksums' \(did you mean 'checksums'\?\)"),
        ({"snapshots": {"every": 0}}, r"^snapshot every=0"),
    ],
)
def test_a_bad_nested_config_value_names_its_section(data, needle):
    with pytest.raises(ValueError, match=needle):
        GuardConfig.from_dict(data)


def test_stall_after_is_validated():
    with pytest.raises(ValueError, match="stall_after=0 must be a positive integer"):
        GuardConfig(stall_after=0)
    assert GuardConfig(stall_after=None).stall_after is None


# -- a --guard-config file: the bare mapping or the one under a top-level `guard:` key -----------
@pytest.mark.parametrize("text", ["guard: {profile: minimal}\n", "profile: minimal\n"], ids=["wrapped", "bare"])
def test_guard_config_load_takes_the_mapping_bare_or_under_a_guard_key(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    config = GuardConfig.load(path)
    assert config.profile == "minimal" and config.abft is None
    assert config == GuardConfig(profile="minimal")


@pytest.mark.parametrize("text", ["guard:\n", "guard: null\n", "guard: {}\n"], ids=repr)
def test_an_empty_guard_key_is_the_defaults(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    assert GuardConfig.load(path) == GuardConfig()


def test_the_docs_form_with_sections_loads_from_a_file_and_the_command_line(tmp_path):
    from sdcscope.cli.options import guard_config

    path = tmp_path / "guard.yaml"
    path.write_text("guard:\n  profile: full\n  abft: {c: 9}\n  replay: false\n")
    config = guard_config(False, path)
    assert (config.profile, config.abft.c, config.abft.layer_fraction, config.replay) == ("full", 9.0, 1.0, False)


def test_keys_beside_a_top_level_guard_key_are_refused_by_name(tmp_path):
    path = tmp_path / "guard.yaml"
    path.write_text("guard: {profile: full}\nabft: {c: 9}\nreplay: false\n")
    with pytest.raises(ValueError, match=r"guard config '.*guard\.yaml': .*'guard'.*\['abft', 'replay'\] stand beside"):
        GuardConfig.load(path)


@pytest.mark.parametrize("text", ["guard: [abft]\n", "guard: full\n"], ids=repr)
def test_a_guard_key_that_holds_no_mapping_is_refused(tmp_path, text):
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    with pytest.raises(TypeError, match=r"guard config '.*guard\.yaml': guard config must be a mapping"):
        GuardConfig.load(path)
