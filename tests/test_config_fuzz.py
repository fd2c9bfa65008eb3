"""Property tests: whatever a user writes, CheckpointConfig either parses it or says which key is wrong.

Never any other exception type, and a parsed config always satisfies its invariants.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gradseam import BACKENDS, CheckpointConfig
from gradseam.config import AUTO

KEYS = CheckpointConfig.keys()
BOOL_KEYS = ("gradient_checkpointing", "gradient_checkpointing_offload_attention",
             "gradient_checkpointing_keep_attention")
OPTIONAL_INT_KEYS = ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride")
BUCKETS = "gradient_checkpointing_offload_pin_memory_max_buckets"
BACKEND = "gradient_checkpointing_backend"

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- values ------------------------------------------------------------------------------------

# Strings a person (or a shell, or a YAML loader) plausibly writes, including ones that look numeric
# to str.isdigit() but not to int().
tricky = st.sampled_from([
    "true", "false", "True", " FALSE ", "yes", "1", "0", "-1", "2", " 3 ", "²", "--2", "٣", "1e3", "null", "",
    "9" * 5000, "-" + "9" * 5000, *BACKENDS, "torch_ffn", "unslot", "TORCH",
])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    tricky,
)
anything = st.one_of(
    tricky,
    scalars,
    st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
        max_leaves=6,
    ),
)

# Values every key certainly accepts (so the error, if any, must come from elsewhere).
GOOD = {
    "gradient_checkpointing": st.sampled_from([True, False, "true", "false", " True "]),
    "gradient_checkpointing_offload_attention": st.sampled_from([True, False, "true", "false"]),
    "gradient_checkpointing_keep_attention": st.sampled_from([True, False, "true", "false"]),
    BACKEND: st.sampled_from(BACKENDS),
    "gradient_checkpointing_interval": st.one_of(st.none(), st.integers(1, 10**20)),
    "gradient_checkpointing_segment_stride": st.one_of(st.none(), st.integers(1, 10**20)),
    BUCKETS: st.integers(0, 10**6),
    "gradient_checkpointing_memory_budget": st.one_of(
        st.none(), st.floats(min_value=0.0, max_value=1.0), st.sampled_from(["0.1", " 0.5 ", 1, 0, "0"])),
    "gradient_checkpointing_stream_weights": st.one_of(
        st.none(), st.integers(0, 10**20), st.sampled_from(["all", " ALL ", "8", "0"])),
    "gradient_checkpointing_stream_prefetch": st.one_of(st.integers(0, 10**6), st.sampled_from(["0", " 2 "])),
    # a size is refused beside any backend but "auto", which the good interval or stride refuse in turn
    "gradient_checkpointing_gpu_memory": st.none(),
    "gradient_checkpointing_host_memory": st.none(),
    "gradient_checkpointing_blocks": st.one_of(st.none(), st.sampled_from([
        [], [{"blocks": "blocks[0:2]", BACKEND: "unsloth"}],
        '[{"blocks": "transformer_blocks", "gradient_checkpointing": false}]'])),
}

unknown_keys = st.one_of(
    st.text(max_size=40).filter(lambda k: k not in KEYS),
    st.sampled_from(["gradient_checkpoint", "gradient_checkpointing_intervals", "Gradient_Checkpointing",
                     "gradient_checkpointing_backend ", "learning_rate"]),
    st.integers(),
)


@st.composite
def configs(draw):
    """A mapping of known keys (good or arbitrary values) plus maybe unknown keys.

    Returns ``(data, suspects)``: the keys whose value may legitimately be refused.
    """
    data: dict = {}
    suspects: set = set()
    for key in draw(st.lists(st.sampled_from(KEYS), unique=True)):
        if draw(st.booleans()):
            data[key] = draw(GOOD[key])
        else:
            data[key] = draw(anything)
            suspects.add(key)
    for key in draw(st.lists(unknown_keys, max_size=2, unique=True)):
        data[key] = draw(anything)
        suspects.add(key)
    # shuffle the order: errors must name a key wherever it sits
    items = draw(st.permutations(list(data.items())))
    return dict(items), suspects


def _named_key(message: str, data: dict):
    """The key an error message is about (the message starts with it), or None."""
    for key in data:
        if message.startswith(f"unknown gradseam config key {key!r}.") or message.startswith(
            f"gradseam config key '{key}':"
        ):
            return key
    return None


def _check_invariants(cfg: CheckpointConfig) -> None:
    assert type(cfg.gradient_checkpointing) is bool
    assert type(cfg.gradient_checkpointing_offload_attention) is bool
    assert cfg.gradient_checkpointing_backend in (*BACKENDS, AUTO)
    interval = cfg.gradient_checkpointing_interval
    stride = cfg.gradient_checkpointing_segment_stride
    assert interval is None or (type(interval) is int and interval >= 1)
    assert stride is None or (type(stride) is int and stride >= (interval or 1))
    assert type(cfg.pin_buckets) is int and cfg.pin_buckets >= 0
    budget = cfg.gradient_checkpointing_memory_budget
    assert budget is None or (type(budget) is float and 0 <= budget <= 1)
    # a parsed config survives its own round trips
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg
    assert CheckpointConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def _stride_fits(data: dict) -> bool:
    """True unless a (good) stride is shorter than a (good) interval."""
    interval = data.get("gradient_checkpointing_interval")
    stride = data.get("gradient_checkpointing_segment_stride")
    return stride is None or stride >= (interval or 1)


def _assert_outcome(data: dict, suspects: set, *, ignore_unknown: bool) -> None:
    known_suspects = {k for k in suspects if k in KEYS}
    if ignore_unknown:
        suspects = known_suspects
    try:
        cfg = CheckpointConfig.from_dict(data, ignore_unknown=ignore_unknown)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        named = _named_key(message, data)
        assert named is not None, f"error names no key of {data!r}: {message}"
        if named == "gradient_checkpointing_segment_stride" and "must be >= gradient_checkpointing_interval" in message:
            # the window rule: blames the stride, names the interval, needs both keys present
            assert "gradient_checkpointing_interval" in data, message
            return
        if "gradient_checkpointing_backend \"auto\"" in message and BACKEND in suspects:
            return  # an arbitrary backend value that reads "auto": it refuses the keys it decides, good or not
        assert named in suspects, f"error blames {named!r} (value {data[named]!r}), suspects {suspects}: {message}"
        return
    # accepted: nothing was refused although it should have been
    assert ignore_unknown or not [k for k in data if k not in KEYS], "unknown key accepted"
    _check_invariants(cfg)
    for key, value in data.items():
        if key in BOOL_KEYS:
            expected = value if isinstance(value, bool) else value.strip().lower() == "true"
            assert getattr(cfg, key) is expected
        elif key == BACKEND:
            assert cfg.backend == value
        elif key in OPTIONAL_INT_KEYS or key == BUCKETS:
            assert getattr(cfg, key) == (None if value is None else int(value))


@SETTINGS
@given(configs())
@example(({"gradient_checkpointing": True, "gradient_checkpointing_interval": "²"}, {"gradient_checkpointing_interval"}))
@example(({"gradient_checkpointing_segment_stride": "9" * 5000, "lr": 1}, {"gradient_checkpointing_segment_stride", "lr"}))
@example(({"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": "2"},
          {"gradient_checkpointing_segment_stride"}))
def test_from_dict_parses_or_names_the_key(case):
    data, suspects = case
    _assert_outcome(data, suspects, ignore_unknown=False)


@SETTINGS
@given(configs())
@example(({"gradient_checkpointing": True, "gradient_checkpointing_interval": "²"}, {"gradient_checkpointing_interval"}))
@example(({"gradient_checkpointing_segment_stride": "9" * 5000, "lr": 1}, {"gradient_checkpointing_segment_stride", "lr"}))
@example(({"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": "2"},
          {"gradient_checkpointing_segment_stride"}))
def test_from_dict_ignore_unknown_parses_or_names_the_key(case):
    data, suspects = case
    _assert_outcome(data, suspects, ignore_unknown=True)


@SETTINGS
@given(st.fixed_dictionaries({}, optional=GOOD))
def test_good_values_always_parse(data):
    if not _stride_fits(data):
        return
    cfg = CheckpointConfig.from_dict(data)
    _check_invariants(cfg)
    # the same values as keyword arguments give the same config
    assert CheckpointConfig(**data) == cfg


@SETTINGS
@given(st.sampled_from(KEYS), anything)
@example("gradient_checkpointing_interval", "²")
@example("gradient_checkpointing_segment_stride", "--2")
@example("gradient_checkpointing_offload_pin_memory_max_buckets", "9" * 5000)
@example("gradient_checkpointing_blocks", "9" * 5000)  # json.loads raises a ValueError of its own past int()'s limit
@example("gradient_checkpointing_blocks", "[" * 100_000)  # and a RecursionError nested this deep
def test_single_key_any_value(key, value):
    try:
        cfg = CheckpointConfig(**{key: value})
    except ValueError as exc:
        assert str(exc).startswith(f"gradseam config key '{key}':"), str(exc)
        return
    _check_invariants(cfg)


def _parse(text: str) -> tuple[object, list[str]]:
    """json.loads, and what from_json refuses although json takes it: keys seen twice, integers longer
    than int() converts. Returns (document or None, the refused keys, if any)."""
    refused: list[str] = []

    def pairs(items):
        keys = [k for k, _ in items]
        refused.extend(k for k in set(keys) if keys.count(k) > 1)
        return dict(items)

    def parse_int(digits):
        try:
            return int(digits)
        except ValueError:
            refused.append(digits)
            return 0

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_int=parse_int), refused
    except (ValueError, RecursionError):
        return None, []


# JSON objects written by hand: keys may repeat, integers may be too long for int()
hand_written = st.lists(
    st.tuples(st.sampled_from([*KEYS[:3], "lr"]), st.sampled_from(["true", "2", "null", '"torch"', "9" * 5000])),
    max_size=4,
).map(lambda pairs: "{" + ", ".join(f'"{k}": {v}' for k, v in pairs) + "}")


@SETTINGS
@example(text="[" * 100_000)
@example(text='{"gradient_checkpointing_interval": "--2"}')
@example(text='{"gradient_checkpointing": true, "gradient_checkpointing": true}')
@example(text='{"lr": ' + "9" * 5000 + "}")
@given(text=st.one_of(st.text(max_size=80), hand_written, st.builds(json.dumps, configs().map(lambda c: {
    str(k): v for k, v in c[0].items()}))))
def test_from_json_any_text(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "fuzz_config.json"
    path.write_text(text, encoding="utf-8")
    parsed, refused = _parse(text)
    try:
        cfg = CheckpointConfig.from_json(path)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if isinstance(parsed, dict) and refused:
            # a file-level problem json would have hidden: the file and the key are named
            assert message.startswith(f"gradseam config file {str(path)!r}: key "), message
            assert "appears more than once" in message or "digits" in message, message
        elif isinstance(parsed, dict):
            # the file is a JSON object: the error is the same as from_dict's, about a key
            assert _named_key(message, parsed) is not None, message
            try:
                CheckpointConfig.from_dict(parsed)
            except (ValueError, TypeError) as direct:
                assert str(direct) == message
            else:
                raise AssertionError("from_json refused what from_dict accepts") from exc
        else:
            assert repr(str(path)) in message, message
            assert ("not valid JSON" in message) or ("must hold a JSON object" in message)
        return
    assert isinstance(parsed, dict) and not refused
    assert cfg == CheckpointConfig.from_dict(parsed)
    _check_invariants(cfg)


@SETTINGS
@given(anything.filter(lambda v: not isinstance(v, str)), st.dictionaries(st.sampled_from(KEYS), anything, max_size=2))
@example(True, {})
@example(0, {"gradient_checkpointing": True})
@example([], {})
def test_coerce_any_value(value, kwargs):
    """coerce (what patch() and patching() call) takes a mapping or None, or names the argument's type."""
    try:
        cfg = CheckpointConfig.coerce(value, **kwargs)
    except TypeError as exc:
        assert not isinstance(value, dict) and value is not None
        assert str(exc).startswith("gradseam: the config argument must be a CheckpointConfig, a mapping of "), exc
        assert f"; got {type(value).__name__} " in str(exc)
        return
    except ValueError as exc:
        assert isinstance(value, dict) or value is None
        assert _named_key(str(exc), {**(value or {}), **kwargs}) is not None, str(exc)
        return
    assert isinstance(value, dict) or value is None
    assert cfg == CheckpointConfig.from_dict({**(value or {}), **kwargs})


# -- the whole key space through patch(): it patches exactly, or refuses naming a key ------------------
PATCH_VALUES = {
    "gradient_checkpointing": st.booleans(),
    "gradient_checkpointing_offload_attention": st.booleans(),
    "gradient_checkpointing_keep_attention": st.booleans(),
    BACKEND: st.sampled_from([b for b in BACKENDS if "compile" not in b]),  # compiled: tests/test_compiled_backend.py
    "gradient_checkpointing_interval": st.one_of(st.none(), st.integers(1, 6)),
    "gradient_checkpointing_segment_stride": st.one_of(st.none(), st.integers(1, 7)),
    BUCKETS: st.integers(0, 3),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=PATCH_VALUES), st.sampled_from(["wan", "flux"]))
def test_every_combination_of_keys_patches_exactly_or_names_a_key(data, family):
    from cases import FLUX, WAN

    import gradseam
    from gradseam.errors import UnsupportedStrategyError
    from gradseam.offload import cpu_test_mode
    from gradseam.testing import assert_same_step, run_step

    case = {"wan": WAN, "flux": FLUX}[family]
    model, reference = case.twins()
    with cpu_test_mode():
        try:
            handle = gradseam.patch(model, data)
        except (ValueError, UnsupportedStrategyError) as exc:
            named = [k for k in data if k in str(exc)] + [v for v in BACKENDS if repr(v) in str(exc)]
            assert named, f"{data}: the error names no key: {exc}"
            return
        with handle:
            assert_same_step(run_step(reference, case), run_step(model, case), what=str(data))
