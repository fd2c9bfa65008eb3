"""CheckpointConfig: the exact user keys, strict parsing and the content of every error message."""

from __future__ import annotations

import json

import pytest

import gradseam
from gradseam import BACKENDS, CheckpointConfig
from gradseam.backends import Offload, Scope
from gradseam.config import DEFAULT_PIN_BUCKETS
from gradseam.spec import strategy_of

KEYS = (
    "gradient_checkpointing",
    "gradient_checkpointing_backend",
    "gradient_checkpointing_interval",
    "gradient_checkpointing_segment_stride",
    "gradient_checkpointing_offload_attention",
    "gradient_checkpointing_offload_pin_memory_max_buckets",
    "gradient_checkpointing_keep_attention",
    "gradient_checkpointing_memory_budget",
    "gradient_checkpointing_stream_weights",
    "gradient_checkpointing_stream_prefetch",
    "gradient_checkpointing_gpu_memory",
    "gradient_checkpointing_host_memory",
    "gradient_checkpointing_blocks",
)

# One non-default value for every key, as a trainer would write it.
FULL = {
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "unsloth-ffn",
    "gradient_checkpointing_interval": 2,
    "gradient_checkpointing_segment_stride": 5,
    "gradient_checkpointing_offload_attention": True,
    "gradient_checkpointing_offload_pin_memory_max_buckets": 3,
    "gradient_checkpointing_keep_attention": True,
    "gradient_checkpointing_memory_budget": 0.3,
    "gradient_checkpointing_stream_weights": "all",
    "gradient_checkpointing_stream_prefetch": 2,
    # the budgets of backend "auto", which the keys above exclude (test_auto.py sets them beside it)
    "gradient_checkpointing_gpu_memory": None,
    "gradient_checkpointing_host_memory": None,
    "gradient_checkpointing_blocks": [{"blocks": "blocks[0:2]", "gradient_checkpointing_backend": "torch"}],
}


def _assert_full(cfg: CheckpointConfig) -> None:
    assert cfg.gradient_checkpointing is True
    assert cfg.gradient_checkpointing_backend == "unsloth-ffn"
    assert cfg.gradient_checkpointing_interval == 2
    assert cfg.gradient_checkpointing_segment_stride == 5
    assert cfg.gradient_checkpointing_offload_attention is True
    assert cfg.gradient_checkpointing_offload_pin_memory_max_buckets == 3
    # the short names read the same values
    assert (cfg.enabled, cfg.backend, cfg.interval, cfg.stride, cfg.offload_attention, cfg.pin_buckets) == (
        True, "unsloth-ffn", 2, 5, True, 3,
    )
    strategy = strategy_of(cfg)
    assert strategy.backend.scope is Scope.FFN and strategy.backend.offload is Offload.INPUTS


def _write(tmp_path, text: str, name: str = "gradseam.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# -- keys and sources --------------------------------------------------------------------------


def test_keys_are_exactly_the_user_keys():
    assert CheckpointConfig.keys() == KEYS
    assert set(FULL) == set(KEYS)


def test_defaults():
    cfg = CheckpointConfig()
    assert cfg.gradient_checkpointing is False
    assert cfg.gradient_checkpointing_backend == "torch"
    assert cfg.gradient_checkpointing_interval is None
    assert cfg.gradient_checkpointing_segment_stride is None
    assert cfg.gradient_checkpointing_offload_attention is False
    assert cfg.gradient_checkpointing_offload_pin_memory_max_buckets == DEFAULT_PIN_BUCKETS == 12
    assert cfg.interval == 1 and cfg.stride is None
    assert strategy_of(cfg).backend is None and not strategy_of(cfg).destinations  # checkpointing off
    assert cfg.describe() == "no checkpointing"
    assert CheckpointConfig.from_dict({}) == cfg
    assert CheckpointConfig.coerce() == cfg
    assert CheckpointConfig.coerce(None) == cfg


def test_every_key_from_kwargs():
    _assert_full(CheckpointConfig(**FULL))


def test_every_key_from_dict():
    _assert_full(CheckpointConfig.from_dict(FULL))


def test_every_key_from_json(tmp_path):
    _assert_full(CheckpointConfig.from_json(_write(tmp_path, json.dumps(FULL))))
    # str paths work as well as PathLike
    _assert_full(CheckpointConfig.from_json(str(_write(tmp_path, json.dumps(FULL), "b.json"))))


def test_every_key_through_coerce():
    _assert_full(CheckpointConfig.coerce(FULL))
    _assert_full(CheckpointConfig.coerce(None, **FULL))
    _assert_full(CheckpointConfig.coerce(CheckpointConfig(**FULL)))
    # kwargs override the mapping / the config
    base = CheckpointConfig.coerce(FULL, gradient_checkpointing_backend="torch")
    assert base.backend == "torch" and base.interval == 2
    over = CheckpointConfig.coerce(CheckpointConfig(**FULL), gradient_checkpointing_interval=None)
    assert over.gradient_checkpointing_interval is None and over.backend == "unsloth-ffn"


def test_json_null_for_optional_ints(tmp_path):
    text = json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_interval": None,
                       "gradient_checkpointing_segment_stride": None})
    cfg = CheckpointConfig.from_json(_write(tmp_path, text))
    assert cfg.gradient_checkpointing_interval is None and cfg.gradient_checkpointing_segment_stride is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_accepted(backend):
    cfg = CheckpointConfig(gradient_checkpointing=True, gradient_checkpointing_backend=backend)
    assert cfg.backend == backend
    strategy = strategy_of(cfg)
    assert (strategy.backend.scope is Scope.FFN) == backend.endswith("-ffn")
    assert (strategy.backend.offload is not Offload.NOTHING) == backend.startswith("unsloth")


def test_to_dict_round_trip(tmp_path):
    cfg = CheckpointConfig(**FULL)
    assert cfg.to_dict() == FULL
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg
    # and through a JSON file, as a trainer would save it
    path = _write(tmp_path, json.dumps(cfg.to_dict()))
    assert CheckpointConfig.from_json(path) == cfg
    assert CheckpointConfig.from_dict(CheckpointConfig().to_dict()) == CheckpointConfig()


def test_parsed_values_are_stored():
    cfg = CheckpointConfig(gradient_checkpointing="TRUE", gradient_checkpointing_offload_attention=" false ",
                           gradient_checkpointing_interval="3")
    assert cfg.gradient_checkpointing is True
    assert cfg.gradient_checkpointing_offload_attention is False
    assert cfg.gradient_checkpointing_interval == 3
    assert cfg.to_dict()["gradient_checkpointing"] is True


def test_config_is_frozen():
    cfg = CheckpointConfig()
    with pytest.raises(AttributeError):
        cfg.gradient_checkpointing = True  # type: ignore[misc]


def test_describe():
    assert CheckpointConfig(**FULL).describe() == ("unsloth-ffn, interval 2, stride 5, attention offload, memory budget 0.3, "
                                                   "1 per-block entry, weights of all blocks streamed (prefetch 2)")
    assert CheckpointConfig(gradient_checkpointing=True).describe() == "torch"


# -- backend -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [("torch_ffn", "torch-ffn"), ("unslot", "unsloth"), ("Torch", "torch"), ("unsloth_ffn", "unsloth-ffn")],
)
def test_backend_typo_suggests(typo, suggestion):
    with pytest.raises(ValueError) as info:
        CheckpointConfig(gradient_checkpointing=True, gradient_checkpointing_backend=typo)
    msg = str(info.value)
    assert "'gradient_checkpointing_backend'" in msg
    assert repr(typo) in msg
    assert f"Did you mean '{suggestion}'?" in msg
    for backend in BACKENDS:  # the allowed values are listed
        assert repr(backend) in msg


def test_backend_nonsense_has_no_suggestion_but_lists_allowed():
    with pytest.raises(ValueError) as info:
        CheckpointConfig(gradient_checkpointing_backend="deepspeed")
    msg = str(info.value)
    assert "'deepspeed'" in msg and "Did you mean" not in msg
    assert str([*BACKENDS, "auto"]) in msg


@pytest.mark.parametrize("value", [None, 1, True, ["torch"]])
def test_backend_wrong_type(value):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({"gradient_checkpointing_backend": value})  # a written null too
    msg = str(info.value)
    assert "'gradient_checkpointing_backend'" in msg and repr(value) in msg and type(value).__name__ in msg


def test_backend_none_as_a_keyword_is_the_default_left_out():
    cfg = CheckpointConfig(gradient_checkpointing_backend=None)
    assert cfg.backend == "torch" and not cfg.enabled


# -- unknown keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("gradient_checkpoint", "gradient_checkpointing"),
        ("gradient_checkpointing_intervals", "gradient_checkpointing_interval"),
        ("gradient_checkpointing_segment_strides", "gradient_checkpointing_segment_stride"),
        ("gradient_checkpointing_offload_attn", "gradient_checkpointing_offload_attention"),
    ],
)
def test_unknown_key_suggests_closest(typo, suggestion):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({typo: True})
    msg = str(info.value)
    assert msg.startswith(f"unknown gradseam config key {typo!r}.")
    assert f"Did you mean '{suggestion}'?" in msg
    assert "ignore_unknown=True" in msg
    for key in KEYS:
        assert repr(key) in msg


def test_unknown_key_without_close_match():
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({"learning_rate": 1e-4})
    msg = str(info.value)
    assert "'learning_rate'" in msg and "Did you mean" not in msg


def test_unknown_key_rejected_from_json_too(tmp_path):
    path = _write(tmp_path, json.dumps({"gradient_checkpoint": True}))
    with pytest.raises(ValueError, match=r"Did you mean 'gradient_checkpointing'\?"):
        CheckpointConfig.from_json(path)


def test_unknown_key_through_coerce_and_patch_kwargs():
    with pytest.raises(ValueError, match=r"Did you mean 'gradient_checkpointing'\?"):
        CheckpointConfig.coerce(None, gradient_checkpoint=True)
    # kwargs on top of an existing config are checked the same way (not a bare dataclass TypeError)
    with pytest.raises(ValueError, match=r"Did you mean 'gradient_checkpointing_interval'\?"):
        CheckpointConfig.coerce(CheckpointConfig(), gradient_checkpointing_intervall=2)


def test_kwargs_unknown_key_names_it():
    with pytest.raises(TypeError, match="gradient_checkpoint"):
        CheckpointConfig(gradient_checkpoint=True)  # type: ignore[call-arg]


TRAINER_CONFIG = {
    "model_family": "flux",
    "learning_rate": 1e-4,
    "train_batch_size": 1,
    "mixed_precision": "bf16",
    "gradient_checkpointing": "true",
    "gradient_checkpointing_backend": "torch-ffn",
    "gradient_checkpointing_interval": 2,
    "gradient_checkpointing_segment_stride": 4,
    "optimizer": {"name": "adamw", "betas": [0.9, 0.99]},
    "validation_prompts": ["a cat"],
}


def test_ignore_unknown_reads_gradseam_keys_out_of_trainer_config(tmp_path):
    with pytest.raises(ValueError, match="'model_family'"):
        CheckpointConfig.from_dict(TRAINER_CONFIG)
    cfg = CheckpointConfig.from_dict(TRAINER_CONFIG, ignore_unknown=True)
    assert cfg == CheckpointConfig(
        gradient_checkpointing=True,
        gradient_checkpointing_backend="torch-ffn",
        gradient_checkpointing_interval=2,
        gradient_checkpointing_segment_stride=4,
    )
    path = _write(tmp_path, json.dumps(TRAINER_CONFIG))
    assert CheckpointConfig.from_json(path, ignore_unknown=True) == cfg
    with pytest.raises(ValueError, match="ignore_unknown=True"):
        CheckpointConfig.from_json(path)


def test_ignore_unknown_still_validates_gradseam_keys():
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({**TRAINER_CONFIG, "gradient_checkpointing_backend": "unslot"}, ignore_unknown=True)
    assert "'gradient_checkpointing_backend'" in str(info.value) and "'unsloth'" in str(info.value)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(TypeError, match="mapping.*list"):
        CheckpointConfig.from_dict([("gradient_checkpointing", True)])  # type: ignore[arg-type]


# -- booleans ----------------------------------------------------------------------------------

BOOL_KEYS = ("gradient_checkpointing", "gradient_checkpointing_offload_attention")


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize(("text", "expected"), [("true", True), ("false", False), ("True", True),
                                                 ("FALSE", False), (" true ", True), (True, True),
                                                 (False, False)])
def test_bool_strings_parsed(key, text, expected):
    cfg = CheckpointConfig.from_dict({key: text})
    assert getattr(cfg, key) is expected


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value", ["yes", "no", "1", "0", 1, 0, None, "", "on", 1.0, [True]])
def test_bool_lookalikes_rejected_with_key(key, value):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: value})
    msg = str(info.value)
    assert msg.startswith(f"gradseam config key '{key}':")
    assert "expected true or false" in msg
    assert repr(value) in msg and type(value).__name__ in msg


# -- integers ----------------------------------------------------------------------------------

INT_KEYS = ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [0, -1, -100])
def test_interval_and_stride_below_one_rejected(key, value):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: value})
    msg = str(info.value)
    assert msg.startswith(f"gradseam config key '{key}':")
    assert f"must be >= 1, got {value}" in msg
    assert "use null to disable" in msg


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [True, False])
def test_interval_and_stride_bool_rejected(key, value):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: value})
    msg = str(info.value)
    assert msg.startswith(f"gradseam config key '{key}':") and repr(value) in msg and "(bool)" in msg


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [2.0, 1.5, float("nan"), "two", "2.0", [2], {"n": 2}])
def test_interval_and_stride_non_integer_rejected(key, value):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: value})
    msg = str(info.value)
    assert msg.startswith(f"gradseam config key '{key}':")
    assert "an integer >= 1 or null" in msg
    assert repr(value) in msg


@pytest.mark.parametrize("value", ["²", "--2", "9" * 5000, "-"])
def test_odd_digit_strings_rejected_with_key(value):
    # str.isdigit() is true for '²', and int() refuses some digit strings: still a keyed message
    with pytest.raises(ValueError) as info:
        CheckpointConfig(gradient_checkpointing_interval=value)
    assert str(info.value).startswith("gradseam config key 'gradient_checkpointing_interval':")


def test_interval_string_digits_accepted():
    assert CheckpointConfig(gradient_checkpointing_interval=" 4 ").gradient_checkpointing_interval == 4


def test_stride_shorter_than_interval_rejected_naming_both():
    with pytest.raises(ValueError) as info:
        CheckpointConfig(gradient_checkpointing=True, gradient_checkpointing_interval=3,
                         gradient_checkpointing_segment_stride=2)
    msg = str(info.value)
    assert "'gradient_checkpointing_segment_stride'" in msg
    assert "gradient_checkpointing_interval (3)" in msg
    assert "got 2" in msg


def test_stride_equal_to_interval_and_longer_accepted():
    assert CheckpointConfig(gradient_checkpointing_interval=3, gradient_checkpointing_segment_stride=3).stride == 3
    cfg = CheckpointConfig(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=7)
    assert (cfg.interval, cfg.stride) == (2, 7)
    # without an interval any stride >= 1 is fine
    assert CheckpointConfig(gradient_checkpointing_segment_stride=1).stride == 1


def test_pin_buckets():
    key = "gradient_checkpointing_offload_pin_memory_max_buckets"
    assert CheckpointConfig.from_dict({key: 0}).pin_buckets == 0
    assert CheckpointConfig.from_dict({key: 64}).pin_buckets == 64
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: -1})
    msg = str(info.value)
    assert msg.startswith(f"gradseam config key '{key}':") and "must be >= 0, got -1" in msg
    assert "null" not in msg  # null is not an option for this key
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({key: None})
    assert f"'{key}'" in str(info.value) and "got None" in str(info.value)
    with pytest.raises(ValueError, match=rf"'{key}'.*\(bool\)"):
        CheckpointConfig.from_dict({key: True})


# -- JSON files --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("", "not valid JSON"),
        ("   \n", "not valid JSON"),
        ('{"gradient_checkpointing": tr', "not valid JSON"),
        ('{"gradient_checkpointing": true,', "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        ('["gradient_checkpointing"]', "must hold a JSON object of keys, got list"),
        ("true", "must hold a JSON object of keys, got bool"),
        ('"gradient_checkpointing"', "must hold a JSON object of keys, got str"),
        ("null", "must hold a JSON object of keys, got NoneType"),
    ],
    ids=["empty", "blank", "truncated-value", "truncated-object", "deeply-nested", "list", "bool", "str", "null"],
)
def test_bad_json_file_names_the_file(tmp_path, text, what):
    path = _write(tmp_path, text, "train_config.json")
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_json(path)
    msg = str(info.value)
    assert repr(str(path)) in msg
    assert what in msg


def test_json_value_errors_name_the_key(tmp_path):
    path = _write(tmp_path, json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_interval": 0}))
    with pytest.raises(ValueError, match=r"^gradseam config key 'gradient_checkpointing_interval': must be >= 1"):
        CheckpointConfig.from_json(path)


def test_missing_json_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CheckpointConfig.from_json(tmp_path / "nope.json")


# -- what patch() / patching() accept as a config ------------------------------------------------

NOT_A_CONFIG = "gradseam: the config argument must be a CheckpointConfig, a mapping of config keys, the path of " \
    "a JSON config file (str or os.PathLike), or None (keyword arguments only); got "
SWITCH_ON = " To switch checkpointing on, pass gradient_checkpointing=True or {'gradient_checkpointing': True}."
PAIRS = " A list of pairs is not a mapping: pass dict(...) of it."


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "bool True." + SWITCH_ON),
        (False, "bool False." + SWITCH_ON),
        (0, "int 0."),
        (1, "int 1."),
        (0.0, "float 0.0."),
        ([], "list []." + PAIRS),
        ([("gradient_checkpointing", True)], "list [('gradient_checkpointing', True)]." + PAIRS),
        ((), "tuple ()." + PAIRS),
        (set(), "set set()."),
        (b"config.json", "bytes b'config.json'. A path must be str or os.PathLike: decode it."),
    ],
    ids=["true", "false", "zero", "one", "float", "empty-list", "pairs", "tuple", "set", "bytes"],
)
def test_non_mapping_config_is_a_type_error(value, shown):
    # falsy ones used to mean "defaults", True crashed with "'bool' object is not iterable"
    for call in (
        lambda: CheckpointConfig.coerce(value),
        lambda: CheckpointConfig.coerce(value, gradient_checkpointing=True),
        lambda: gradseam.patching(value).__enter__(),
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == NOT_A_CONFIG + shown


def test_patch_with_a_non_mapping_config_leaves_the_model_alone():
    from cases import WAN

    model = WAN.build()
    for value in (True, 0, []):
        with pytest.raises(TypeError, match="^gradseam: the config argument must be"):
            gradseam.patch(model, value)
        assert gradseam.handle_of(model) is None


def test_mappings_none_and_paths_still_accepted(tmp_path):
    from types import MappingProxyType

    assert CheckpointConfig.coerce(None) == CheckpointConfig()
    assert CheckpointConfig.coerce({}) == CheckpointConfig()
    _assert_full(CheckpointConfig.coerce(MappingProxyType(FULL)))
    _assert_full(CheckpointConfig.coerce(_write(tmp_path, json.dumps(FULL))))
    _assert_full(CheckpointConfig.coerce(str(_write(tmp_path, json.dumps(FULL), "s.json"))))


IGNORE_UNKNOWN = (
    "gradseam: ignore_unknown is not a config key, and patch() / patching() read every keyword as one. To read "
    "the gradseam keys out of a larger trainer config, pass CheckpointConfig.from_dict(trainer_config, "
    "ignore_unknown=True) (or CheckpointConfig.from_json(path, ignore_unknown=True)) as the config."
)


@pytest.mark.parametrize(
    "config", [None, FULL, CheckpointConfig(**FULL), TRAINER_CONFIG], ids=["none", "dict", "config", "trainer"]
)
def test_ignore_unknown_as_a_patch_keyword_is_refused(config):
    from cases import WAN

    model = WAN.build()
    for call in (
        lambda: CheckpointConfig.coerce(config, ignore_unknown=True),
        lambda: gradseam.patch(model, config, ignore_unknown=True),
        lambda: gradseam.patching(config, ignore_unknown=True).__enter__(),
    ):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == IGNORE_UNKNOWN
    assert gradseam.handle_of(model) is None
    # what the message recommends works
    assert CheckpointConfig.from_dict(TRAINER_CONFIG, ignore_unknown=True).gradient_checkpointing_interval == 2


def test_json_text_instead_of_a_path():
    with pytest.raises(ValueError) as info:
        CheckpointConfig.coerce(json.dumps(FULL))
    assert str(info.value) == (
        "gradseam: a str config is read as the path of a JSON file, but this one looks like JSON text; pass "
        "json.loads(text) instead."
    )


# -- JSON files: what json.loads takes silently or reports without the file -------------------

HUGE = "9" * 5000


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"gradient_checkpointing_interval": ' + HUGE + "}", "gradient_checkpointing_interval"),
        ('{"gradient_checkpointing_offload_pin_memory_max_buckets": -' + HUGE + "}",
         "gradient_checkpointing_offload_pin_memory_max_buckets"),
        ('{"gradient_checkpointing": true, "optimizer": {"steps": [1, ' + HUGE + "]}}", "optimizer.steps[1]"),
    ],
    ids=["known-key", "negative", "nested"],
)
@pytest.mark.parametrize("ignore_unknown", [False, True])
def test_json_huge_integer_names_file_and_key(tmp_path, text, key, ignore_unknown):
    path = _write(tmp_path, text, "train_config.json")
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_json(path, ignore_unknown=ignore_unknown)
    assert str(info.value) == (
        f"gradseam config file {str(path)!r}: key {key!r} holds an integer of 5000 digits, more than Python "
        "converts (4300, see sys.set_int_max_str_digits); no gradseam setting takes such a number."
    )
    assert info.value.__cause__ is None and info.value.__context__ is None  # not Python's raw error


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"gradient_checkpointing": true, "gradient_checkpointing": false}', "gradient_checkpointing"),
        ('{"gradient_checkpointing_interval": 2, "gradient_checkpointing": true, "gradient_checkpointing_interval": 2}',
         "gradient_checkpointing_interval"),
        ('{"gradient_checkpointing": true, "optimizer": {"lr": 1, "lr": 2}}', "optimizer.lr"),
        ('{"gradient_checkpointing": true, "datasets": [{"id": 1}, {"id": 2, "id": 3}]}', "datasets[1].id"),
    ],
    ids=["conflicting", "same-value", "nested", "in-a-list"],
)
@pytest.mark.parametrize("ignore_unknown", [False, True])
def test_json_duplicate_key_names_file_and_key(tmp_path, text, key, ignore_unknown):
    path = _write(tmp_path, text, "train_config.json")
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_json(path, ignore_unknown=ignore_unknown)
    assert str(info.value) == (
        f"gradseam config file {str(path)!r}: key {key!r} appears more than once. JSON readers keep the last "
        "value without a word, so the file does not say which one it means; remove the duplicate."
    )
    with pytest.raises(ValueError, match="appears more than once"):  # patch() reads files the same way
        CheckpointConfig.coerce(path)


def test_json_long_integer_within_the_limit_parses(tmp_path):
    path = _write(tmp_path, '{"gradient_checkpointing_interval": ' + "9" * 4000 + "}")
    cfg = CheckpointConfig.from_json(path)  # a large interval is legal, if pointless
    assert cfg.gradient_checkpointing_interval == int("9" * 4000)


def test_package_exports():
    assert gradseam.CheckpointConfig is CheckpointConfig
    assert gradseam.BACKENDS == ("torch", "torch-ffn", "unsloth", "unsloth-ffn", "compile", "unsloth-compile")
