"""Per-block plans (``gradient_checkpointing_blocks``): some blocks run other settings than the rest.

The explicit form of what the planner of issue 41 will choose by itself: each entry selects blocks of one
list and sets what a region does for them (backend, memory budget, kept or offloaded attention, checkpointing
off), over the top-level keys, later entries winning. Checked here: a mix is exact and every block runs its
own entry; a chunk never spans two entries; per-block budgets reach the specs; every refusal names the entry;
the config round-trips as a trainer writes it.
"""

from __future__ import annotations

import json

import pytest
from cases import FLUX, WAN

import gradseam
from gradseam.config import CheckpointConfig
from gradseam.errors import UnsupportedStrategyError
from gradseam.offload import cpu_test_mode
from gradseam.patcher import family_for
from gradseam.planning import plan
from gradseam.testing import check_strategy

BLOCKS = "gradient_checkpointing_blocks"
BACKEND = "gradient_checkpointing_backend"


def _kinds(handle: gradseam.PatchHandle) -> dict[str, str]:
    return {r.label: r.kind for r in handle.regions()}


def test_a_mix_of_backends_is_exact_and_each_block_runs_its_entry():
    config = {"gradient_checkpointing": True, BLOCKS: [
        {"blocks": "transformer_blocks[0:1]", BACKEND: "unsloth"},
        {"blocks": "single_transformer_blocks[1:]", "gradient_checkpointing": False},
        {"blocks": "single_transformer_blocks[0]", BACKEND: "torch-ffn"},
    ]}
    with cpu_test_mode():
        report = check_strategy(FLUX, config)  # outputs and every gradient against the unpatched model
        model = FLUX.fresh()
        with gradseam.patch(model, config) as handle:
            regions = {(r.list_path, r.blocks): (r.kind, r.destination.value) for r in handle.regions()}
            summary = str(handle.summary())
    assert regions[("transformer_blocks", (0,))] == ("whole-block", "host")  # unsloth: inputs to host memory
    assert regions[("transformer_blocks", (1,))] == ("whole-block", "device")  # the top level: torch
    assert regions[("single_transformer_blocks", (0,))][0] == "ffn-seam"
    assert not any(path == "single_transformer_blocks" and blocks[0] >= 1 for path, blocks in regions)
    assert report.saved_ratio < 1.0
    assert "3 per-block entries" in summary and "single_transformer_blocks[1..4]" in summary


def test_later_entries_win_and_unselected_blocks_keep_the_top_level():
    config = CheckpointConfig.from_dict({BACKEND: "torch", BLOCKS: [
        {"blocks": "blocks", BACKEND: "torch-ffn"},
        {"blocks": "blocks[2:4]", BACKEND: "torch"},
    ]})
    planned = plan(WAN.fresh(), family_for(WAN.fresh()), config)
    shapes = [(r.blocks, r.shape.value) for r in planned.regions]
    assert [b for b, s in shapes if s == "block"] == [(2,), (3,)]
    assert {b for b, s in shapes if s == "ffn"} == {(0,), (1,), (4,)}
    assert [b for b, _ in shapes] == sorted(b for b, _ in shapes)  # merged in block order


def test_a_chunk_never_spans_two_entries():
    config = {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2,
              BLOCKS: [{"blocks": "blocks[1]", BACKEND: "unsloth"}]}
    with cpu_test_mode():
        check_strategy(WAN, config)
        with gradseam.patch(WAN.fresh(), config) as handle:
            spans = [(r.blocks, r.destination.value) for r in handle.regions()]
    assert spans == [((0,), "device"), ((1,), "host"), ((2, 3), "device"), ((4,), "device")]


def test_each_compiled_block_gets_its_entrys_budget():
    config = CheckpointConfig.from_dict({BACKEND: "compile", BLOCKS: [
        {"blocks": "single_transformer_blocks[0:2]", "gradient_checkpointing_memory_budget": 0.3},
        {"blocks": "transformer_blocks", BACKEND: "unsloth-compile", "gradient_checkpointing_memory_budget": 0.05},
    ]})
    model = FLUX.fresh()
    budgets = {(r.list_path, r.blocks[0]): (r.backend, r.memory_budget)
               for r in plan(model, family_for(model), config).regions}
    assert budgets[("transformer_blocks", 0)] == ("unsloth-compile", 0.05)
    assert budgets[("single_transformer_blocks", 1)] == ("compile", 0.3)
    assert budgets[("single_transformer_blocks", 2)] == ("compile", 0.1)  # the default budget


@pytest.mark.compiled
def test_blocks_compiled_under_two_budgets_are_exact():
    config = {BACKEND: "compile", BLOCKS: [{"blocks": "single_transformer_blocks[0:3]",
                                            "gradient_checkpointing_memory_budget": 0.3}]}
    check_strategy(FLUX, config, atol=1e-5)


@pytest.mark.parametrize(("entry", "words"), [
    ({"blocks": "double_blocks[0:2]", BACKEND: "unsloth"},
     ["[0] selects 'double_blocks[0:2]'", "no block list 'double_blocks'", "transformer_blocks (2 blocks)"]),
    ({"blocks": "transformer_blocks[1:3]", BACKEND: "unsloth"},
     ["transformer_blocks has 2 blocks", "indices 0 to 1"]),
    ({"blocks": "transformer_blocks[5]", BACKEND: "unsloth"}, ["transformer_blocks has 2 blocks"]),
])
def test_a_selector_outside_the_model_is_refused_naming_its_lists(entry, words):
    model = FLUX.fresh()
    with pytest.raises(UnsupportedStrategyError) as info:
        gradseam.patch(model, gradient_checkpointing=True, gradient_checkpointing_blocks=[entry])
    assert all(w in str(info.value) for w in words), str(info.value)
    assert gradseam.handle_of(model) is None


@pytest.mark.parametrize(("entries", "words"), [
    ([{"blocks": "blocks[0:2]", "gradient_checkpointing_interval": 2}],
     ["gradient_checkpointing_blocks': entry 0:", "cannot be set per block", "the model's, not a block's"]),
    ([{"blocks": "blocks", "gradient_checkpointing_backend": "unsloth"}, {"blocks": "blocks[0:", BACKEND: "torch"}],
     ["gradient_checkpointing_blocks': entry 1:", "'blocks[0:'", "the end excluded"]),
    ([{"blocks": "blocks", BACKEND: "nope"}], ["gradient_checkpointing_blocks': entry 0 ('blocks'): gradseam config "
                                                "key 'gradient_checkpointing_backend': 'nope' is not a backend"]),
    ([{"blocks": "blocks"}], ["sets nothing for 'blocks'"]),
    ([{"blocks": "blocks", "gradient_checkpointing_backnd": "torch"}], ["did you mean 'gradient_checkpointing_backend'"]),
    ({"blocks": "blocks"}, ["expected a list of entries"]),
])
def test_an_entry_is_validated_like_the_top_level_keys(entries, words):
    with pytest.raises(ValueError) as info:
        CheckpointConfig.from_dict({BLOCKS: entries})
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_entries_round_trip_as_a_trainer_writes_them():
    written = {"gradient_checkpointing": True, BLOCKS: [
        {"blocks": "transformer_blocks[0:1]", BACKEND: "unsloth", "gradient_checkpointing_offload_attention": True},
    ]}
    config = CheckpointConfig.from_dict(written)
    assert CheckpointConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert CheckpointConfig.from_dict(config.given_keys()) == config
    assert CheckpointConfig.from_dict({BLOCKS: json.dumps(written[BLOCKS]), "gradient_checkpointing": True}) == config
    assert config.to_dict()[BLOCKS] == written[BLOCKS]


def test_an_offloading_entry_on_a_cpu_model_is_refused_as_the_top_level_would_be():
    model = FLUX.fresh()
    with pytest.raises(UnsupportedStrategyError, match="backend 'unsloth' moves activations"):
        gradseam.patch(model, gradient_checkpointing=True,
                       gradient_checkpointing_blocks=[{"blocks": "transformer_blocks[0]", BACKEND: "unsloth"}])
    assert gradseam.handle_of(model) is None


def test_entries_alone_checkpoint_only_their_blocks():
    config = CheckpointConfig.from_dict({BLOCKS: [{"blocks": "blocks[0:2]", BACKEND: "torch"}]})
    assert not config.gradient_checkpointing  # nothing at the top level turns it on
    planned = plan(WAN.fresh(), family_for(WAN.fresh()), config)
    assert [r.blocks for r in planned.regions] == [(0,), (1,)]
    assert [p[1] for p in planned.plain] == [2, 3, 4]


def test_gradseam_run_takes_the_entries_as_json():
    from gradseam.tools.launch import LaunchError, build_config

    entries = '[{"blocks": "blocks[0:2]", "gradient_checkpointing_backend": "unsloth"}]'
    config = build_config(flags={"--blocks": entries, "--backend": "torch"})
    assert config.gradient_checkpointing and config.to_dict()[BLOCKS] == json.loads(entries)
    with pytest.raises(LaunchError, match=r"--blocks \[1\]: entry 0: expected an object"):
        build_config(flags={"--blocks": "[1]"})


def test_entries_covering_every_block_are_what_is_checked_and_described():
    # every block overridden: the blocks' settings are checked (torch-ffn on a family with seams is fine), and
    # the plan's strategy is theirs, so messages speak of what runs
    config = CheckpointConfig.from_dict({BACKEND: "torch", BLOCKS: [{"blocks": "blocks", BACKEND: "torch-ffn"}]})
    planned = plan(WAN.fresh(), family_for(WAN.fresh()), config)
    assert planned.strategy.backend.name == "torch-ffn" and {r.shape.value for r in planned.regions} == {"ffn"}
    from gradseam.family import BlockClass, BlockList, Carry, Family

    no_seam = Family("no-seam-wan", models=("NoSuchModel",), block_lists=(BlockList("blocks", carry=Carry(
        {"hidden_states": None})),), block_classes=tuple(BlockClass(bc.name, attention=bc.attention)
                                                          for bc in family_for(WAN.fresh()).block_classes))
    with pytest.raises(UnsupportedStrategyError, match="torch-ffn"):
        plan(WAN.fresh(), no_seam, config)
