"""Every worker-vllm variable in handler/worker_vllm_env.json is honoured (a setting, or read as
one) or refused at start in one line naming it; the values it accepts change nothing;
docs/configuration.md holds the generated tables.
"""

from __future__ import annotations

import json

import pytest

from handler import config_docs
from handler.config import Settings, SettingsError, load_settings, markdown_table
from handler.worker_vllm_env import HANDLINGS, TABLE_PATH, migration_table, table

VARS = {var.name: var for var in table()}
# Values for the data file's accept words that stand for a set of values.
SAMPLES = {
    "<false>": ["false", "0", "OFF"],
    "<true>": ["true", "1", "Yes"],
    "<bool>": ["true", "false"],
    "<int>": ["0", "4"],
    "<number>": ["0", "2.5"],
    "<any>": ["anything at all", "--flag value"],
}
# Tried in order for a value the variable does not accept.
CANDIDATE_BAD = ["definitely-not-valid", "7", "true", "false"]
CHECKED = ("accepted", "refused")


def _names(*handlings: str) -> list[str]:
    return sorted(name for name, var in VARS.items() if var.handling in handlings)


def _accepted_samples(var) -> list[str]:
    return [s for word in var.accept for s in SAMPLES.get(word, [word, word.upper()])]


def _bad_value(var) -> str | None:
    return next((v for v in CANDIDATE_BAD if not var.accepts(v)), None)


def _refusal_lines(env: dict[str, str]) -> list[str]:
    with pytest.raises(SettingsError) as err:
        load_settings(env)
    return str(err.value).splitlines()


def test_the_data_file_is_well_formed():
    doc = json.loads(TABLE_PATH.read_text())
    assert len(VARS) == len(doc["variables"]), "a name is listed twice"
    settings = set(Settings.env_names())
    for var in table():
        assert var.name == var.name.upper() and set(var.sources) <= set(doc["sources"]), var.name
        assert var.sources and var.handling in HANDLINGS and len(var.note) >= 10, var.name
        if var.handling == "setting":
            assert var.name in settings, f"{var.name}: marked as a setting, Settings lacks it"
        elif var.handling == "alias":
            assert var.target in settings and var.name not in settings, var.name
        elif var.handling in CHECKED:
            assert all(not w.startswith("<") or w in SAMPLES for w in var.accept), var.name
        assert not var.unset or var.handling == "setting", var.name
        from_hub = {"hub", "hub-v2.23"} & set(var.sources)
        assert set(var.hub_defaults) <= {"main", "v2.23"} and (from_hub or not var.hub_defaults)


@pytest.mark.parametrize("name", _names("setting"))
def test_settings_of_the_same_name_are_read_and_their_unset_words_are_unset(name):
    var = VARS[name]
    for value in var.unset:
        assert load_settings({name: value}) == load_settings({}), value
    for value in var.hub_defaults.values():  # worker-vllm's Hub default is a valid value here
        load_settings({name: value})


@pytest.mark.parametrize("name", _names("alias"))
def test_aliases_are_read_as_their_setting(name):
    target = VARS[name].target
    assert load_settings({name: "7"}) == load_settings({target: "7"}) != load_settings({})
    assert load_settings({name: "7", target: "7"}) == load_settings({target: "7"})
    lines = _refusal_lines({name: "7", target: "8"})
    assert len(lines) == 1 and lines[0].startswith(f"invalid environment: {name}:")
    assert target in lines[0]


@pytest.mark.parametrize("name", _names(*CHECKED))
def test_accepted_values_change_nothing_and_others_are_refused_naming_the_variable(name):
    var = VARS[name]
    defaults = load_settings({})
    hub_values = [v for v in var.hub_defaults.values() if var.accepts(v)]  # others: migration test
    for value in ["", *_accepted_samples(var), *hub_values]:
        assert load_settings({name: value}) == defaults, (name, value)
    bad = _bad_value(var)
    if bad is None:
        assert var.accept == ("<any>",), f"{name} accepts every candidate: list it as <any>"
        return
    lines = _refusal_lines({name: bad})
    assert len(lines) == 1 and lines[0].startswith(f"invalid environment: {name}: {var.note}")
    assert lines[0].endswith(f"allowed: {var.allowed()}")


@pytest.mark.parametrize("name", _names("process-env"))
def test_variables_for_libraries_in_the_process_are_left_to_them(name):
    assert load_settings({name: "expandable_segments:True"}) == load_settings({})


def test_every_refusal_at_once_is_one_line_each():
    env = {name: bad for name in _names(*CHECKED) if (bad := _bad_value(VARS[name])) is not None}
    lines = _refusal_lines(env)
    named = [line.removeprefix("invalid environment: ").split(":", 1)[0] for line in lines]
    assert sorted(named) == sorted(env) and len(env) > 40


def test_free_form_values_are_not_repeated_in_the_error():
    secret = "hf_" + "x" * 34
    lines = _refusal_lines(
        {
            "VLLM_EXTRA_ARGS": f"--hf-token {secret}",
            "SPECULATIVE_CONFIG": f'{{"token": "{secret}"}}',
            "QUANTIZATION": "awq",
        }
    )
    assert secret not in "\n".join(lines)
    assert any("got 'awq'" in line for line in lines)  # a short plain value is quoted


def test_names_are_matched_whatever_their_case_as_the_settings_are():
    settings = load_settings({"max_model_len": "auto", "tokenizer": "org/tok"})
    assert settings.tokenizer_name == "org/tok" and settings.max_model_len is None
    line = _refusal_lines({"pipeline_parallel_size": "2"})[0]
    assert line.startswith("invalid environment: PIPELINE_PARALLEL_SIZE:")


def test_docs_hold_the_generated_tables():
    docs = config_docs.DOCS.read_text()
    hint = "regenerate with: python -m handler.config_docs"
    assert config_docs.block(docs, "settings table") == markdown_table(), hint
    assert config_docs.block(docs, "worker-vllm table") == migration_table(), hint
    assert all(f"| `{name}` |" in docs for name in VARS)
