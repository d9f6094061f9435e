"""The worker's settings: env parsing as worker-vllm users write it (auto and 0 as unset, 32k),
one error line naming each bad variable and what it allows, secrets never shown, the settings
table of docs/configuration.md equal to the Settings fields (both directions).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import EngineArgs
from handler.config import Settings, SettingsError, load_settings

REPO = Path(__file__).resolve().parent.parent
SECRET = "hf_SUPERSECRETVALUE123"


def test_defaults_follow_worker_vllm():
    s = load_settings({})
    assert s.model_name is None  # the embedded demo model
    assert s.base_path == "/runpod-volume"
    assert s.openai_response_role == "assistant"
    assert (s.default_batch_size, s.default_min_batch_size, s.default_batch_size_growth_factor) == (
        50,
        1,
        3,
    )
    assert s.raw_openai_output is True
    assert s.engine_mode == "auto"
    assert s.default_max_tokens is None  # not a silent 16: the remaining context
    assert s.enable_prefix_caching is True


def test_env_strings_are_parsed_and_empty_means_unset():
    s = load_settings(
        {
            "MODEL_NAME": "org/model",
            "MAX_MODEL_LEN": "4096",
            "GPU_MEMORY_UTILIZATION": "0.8",
            "ENABLE_PREFIX_CACHING": "false",
            "RAW_OPENAI_OUTPUT": "0",
            "BLOCK_SIZE": "32",
            "DTYPE": "bfloat16",
            "log_level": "debug",
            "ENGINE_MODE": "compiled",
            "DEFAULT_MAX_TOKENS": "",
            "TOKENIZER_NAME": "",
            "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "2.5",
            "UNRELATED_VARIABLE": "whatever",
        }
    )
    assert (
        s.model_name == "org/model" and s.max_model_len == 4096 and s.gpu_memory_utilization == 0.8
    )
    assert s.enable_prefix_caching is False and s.raw_openai_output is False
    assert (
        s.block_size == 32
        and s.dtype == "bfloat16"
        and s.log_level == "DEBUG"
        and s.engine_mode == "compiled"
    )
    assert s.default_max_tokens is None and s.tokenizer_name is None
    assert s.default_batch_size_growth_factor == 2.5


def test_load_settings_reads_os_environ(monkeypatch):
    monkeypatch.setenv("MAX_NUM_SEQS", "7")
    monkeypatch.setenv("OPENAI_SERVED_MODEL_NAME_OVERRIDE", "my-model")
    s = load_settings()
    assert s.max_num_seqs == 7 and s.openai_served_model_name_override == "my-model"
    # An explicit mapping ignores os.environ entirely.
    assert load_settings({}).max_num_seqs == 256


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("ENGINE_MODE", "fast", "jit, compiled, auto"),
        ("DTYPE", "int8", "auto, bfloat16, float16"),
        ("LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
        ("MAX_MODEL_LEN", "-5", "[1, "),
        ("MAX_MODEL_LEN", "lots", "an integer"),
        ("GPU_MEMORY_UTILIZATION", "1.5", "(0.0, 1.0]"),
        ("GPU_MEMORY_UTILIZATION", "0", "(0.0, 1.0]"),
        ("BLOCK_SIZE", "24", "power of two"),
        ("MAX_CONCURRENCY", "-3", "an integer in [1,"),
        ("ENABLE_PREFIX_CACHING", "maybe", "true or false"),
        ("DEFAULT_BATCH_SIZE", "0", "an integer in [1,"),
        ("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "0.5", "a number in [1.0,"),
        ("DEFAULT_MAX_TOKENS", "-1", "an integer in [1,"),
        ("S3_CACHE_URI", "https://bucket/x", "s3://bucket/prefix"),
        ("OPENAI_RESPONSE_ROLE", "r" * 100, "at most 64 characters"),
        ("DEVICE", "tpu", "auto, cuda, cpu"),
    ],
)
def test_each_bad_value_names_the_variable_and_what_it_allows(name, value, allowed):
    with pytest.raises(SettingsError) as err:
        load_settings({name: value})
    message = str(err.value)
    assert f"{name}:" in message
    assert allowed in message
    assert message.count(":") >= 2  # "invalid environment: NAME: why"


def test_several_bad_values_are_reported_together_one_line_each():
    with pytest.raises(SettingsError) as err:
        load_settings(
            {"ENGINE_MODE": "x", "BLOCK_SIZE": "3", "MAX_NUM_SEQS": "many", "QUANTIZATION": "awq"}
        )
    lines = str(err.value).splitlines()
    assert sorted(line.split(":")[1].strip() for line in lines) == [
        "BLOCK_SIZE",
        "ENGINE_MODE",
        "MAX_NUM_SEQS",
        "QUANTIZATION",
    ]
    assert all(line.startswith("invalid environment: ") for line in lines)


@pytest.mark.parametrize("value", ["auto", "AUTO", "0", "-1", "none", ""])
def test_max_model_len_values_worker_vllm_treats_as_unset_are_unset(value):
    assert load_settings({"MAX_MODEL_LEN": value}).max_model_len is None


@pytest.mark.parametrize(
    "value, tokens",
    [
        ("4096", 4096),
        ("32k", 32000),
        ("32K", 32768),
        ("25.6k", 25600),
        ("1M", 1 << 20),
        (" 8192 ", 8192),
    ],
)
def test_max_model_len_reads_vllms_human_readable_counts(value, tokens):
    assert load_settings({"MAX_MODEL_LEN": value}).max_model_len == tokens


@pytest.mark.parametrize("value", ["1.5K", "-2", "lots", "32kk"])
def test_max_model_len_refuses_other_words(value):
    with pytest.raises(SettingsError) as err:
        load_settings({"MAX_MODEL_LEN": value})
    message = str(err.value)
    assert message.startswith("invalid environment: MAX_MODEL_LEN:") and "auto" in message


def test_zero_batched_tokens_is_unset_as_worker_vllm_reads_it():
    assert load_settings({"MAX_NUM_BATCHED_TOKENS": "0"}) == load_settings({})
    assert load_settings({"MAX_NUM_BATCHED_TOKENS": "4096"}).max_num_batched_tokens == 4096


def test_ports_for_runpod_load_balancing():
    s = load_settings({"PORT": "8080", "PORT_HEALTH": "8081", "HEALTH_CHECK_PATH": "/ping"})
    assert (s.port, s.port_health, s.health_check_path) == (8080, 8081, "/ping")
    assert load_settings({}).port is None and load_settings({}).port_health is None
    for name, value, allowed in [
        ("PORT", "70000", "[1, 65535]"),
        ("PORT_HEALTH", "http", "an integer"),
        ("HEALTH_CHECK_PATH", "/health", "/ping"),
    ]:
        with pytest.raises(SettingsError) as err:
            load_settings({name: value})
        assert f"{name}:" in str(err.value) and allowed in str(err.value)


def test_secrets_never_appear_in_repr_str_errors_or_logs(caplog):
    env = {
        "HF_TOKEN": SECRET,
        "AWS_ACCESS_KEY_ID": SECRET + "id",
        "AWS_SECRET_ACCESS_KEY": SECRET + "key",
    }
    s = load_settings(env)
    assert s.hf_token.get_secret_value() == SECRET
    for text in (repr(s), str(s), s.model_dump_json(), str(s.model_dump())):
        assert SECRET not in text
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("settings: %s / %r", s, s)
    assert SECRET not in caplog.text
    # A secret with a bad neighbour: the error names the bad variable and never prints the secret.
    with pytest.raises(SettingsError) as err:
        load_settings({**env, "BLOCK_SIZE": "3"})
    assert SECRET not in str(err.value)


def test_engine_args_carry_the_settings():
    s = load_settings(
        {
            "MAX_MODEL_LEN": "1024",
            "BLOCK_SIZE": "32",
            "MAX_NUM_SEQS": "9",
            "DTYPE": "float32",
            "ENABLE_PREFIX_CACHING": "0",
            "GPU_MEMORY_UTILIZATION": "0.5",
            "SEED": "5",
            "CUSTOM_CHAT_TEMPLATE": "{{ messages[0].content }}",
            "MAX_NUM_BATCHED_TOKENS": "512",
            "ASYNC_SCHEDULING": "false",
        }
    )
    args = s.engine_args("/models/x", "/tokenizers/y")
    assert isinstance(args, EngineArgs)
    assert (args.model, args.tokenizer) == ("/models/x", "/tokenizers/y")
    assert (args.max_model_len, args.block_size, args.max_num_seqs, args.dtype) == (
        1024,
        32,
        9,
        "float32",
    )
    assert (
        args.enable_prefix_caching is False
        and args.gpu_memory_utilization == 0.5
        and args.seed == 5
    )
    assert args.chat_template == "{{ messages[0].content }}" and args.max_num_batched_tokens == 512
    assert args.async_scheduling is False
    # Unset: the engine's own choice (on for a GPU, off on CPU).
    assert load_settings({}).engine_args("/m").async_scheduling is None
    args.validate()  # what the settings allow, the engine accepts


def test_cache_dir_falls_back_to_the_volume_then_home(tmp_path):
    assert str(load_settings({"CACHE_DIR": str(tmp_path / "c")}).resolved_cache_dir()) == str(
        tmp_path / "c"
    )
    assert (
        load_settings({"BASE_PATH": str(tmp_path)}).resolved_cache_dir()
        == tmp_path / "coldbrew-cache"
    )
    missing = tmp_path / "no-volume"
    assert (
        load_settings({"BASE_PATH": str(missing)}).resolved_cache_dir()
        == Path("~/.cache/coldbrew").expanduser()
    )


def test_every_field_is_documented():
    for name, default, description in Settings.env_table():
        assert name == name.upper() and len(description) > 15, name


def _docs_table() -> dict[str, tuple[str, str]]:
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([A-Z0-9_]+)`\s*\|\s*(.*?)\s*\|\s*(.*?)\s*\|\s*$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip("`"), m.group(3))
    return rows


def test_docs_settings_table_matches_the_settings_both_ways():
    rows = _docs_table()
    table = {name: (default, description) for name, default, description in Settings.env_table()}
    assert set(rows) == set(table), (
        f"docs/configuration.md lacks {sorted(set(table) - set(rows))}, has extra "
        f"{sorted(set(rows) - set(table))}; regenerate with: python -m handler.config_docs"
    )
    for name, (default, description) in table.items():
        assert rows[name] == (default, description.replace("|", "\\|")), name


def test_the_markdown_table_is_printed_by_the_module():
    out = subprocess.run(
        [sys.executable, "-m", "handler.config", "--markdown"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    assert out.count("\n| `") == len(Settings.model_fields)


@pytest.mark.parametrize(
    "name, value",
    [
        ("PIPELINE_PARALLEL_SIZE", "2"),
        ("TRUST_REMOTE_CODE", "true"),
        ("QUANTIZATION_PARAM_PATH", "/scales.json"),
    ],
)
def test_worker_vllm_variables_we_cannot_honour_stop_the_start(name, value):
    with pytest.raises(SettingsError) as err:
        load_settings({name: value})
    assert f"{name}:" in str(err.value) and "allowed: unset" in str(err.value)


@pytest.mark.parametrize("value", ["awq", "gptq", "bitsandbytes", "fp4"])
def test_quantization_is_fp8_or_unset_and_other_schemes_are_refused_by_name(value):
    assert load_settings({"QUANTIZATION": "fp8"}).engine_args("/m").quantization == "fp8"
    assert load_settings({"QUANTIZATION": "FP8"}).quantization == "fp8"
    for unset in ("", "none"):
        assert load_settings({"QUANTIZATION": unset}).engine_args("/m").quantization is None
    with pytest.raises(SettingsError) as err:
        load_settings({"QUANTIZATION": value})
    assert "QUANTIZATION: this scheme is not supported" in str(err.value)
    assert f"got '{value}'" in str(err.value) and "allowed: one of fp8" in str(err.value)


def test_harmless_worker_vllm_values_pass():
    load_settings(
        {
            "QUANTIZATION": "",
            "TENSOR_PARALLEL_SIZE": "1",
            "TRUST_REMOTE_CODE": "false",
            "KV_CACHE_DTYPE": "auto",
            "ENFORCE_EAGER": "true",
        }
    )


def test_kv_cache_dtype_reaches_the_engine():
    assert load_settings({}).engine_args("/m").kv_cache_dtype == "auto"
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert load_settings({"KV_CACHE_DTYPE": value}).engine_args("/m").kv_cache_dtype == value
    with pytest.raises(SettingsError, match="KV_CACHE_DTYPE: .*fp8"):
        load_settings({"KV_CACHE_DTYPE": "int8"})
    both = load_settings({"KV_CACHE_DTYPE": "fp8", "TENSOR_PARALLEL_SIZE": "2"}).engine_args("/m")
    assert (both.kv_cache_dtype, both.tensor_parallel_size) == ("fp8", 2)


def test_tensor_parallel_size_reaches_the_engine_and_is_bounded():
    assert load_settings({"TENSOR_PARALLEL_SIZE": "2"}).engine_args("/m").tensor_parallel_size == 2
    with pytest.raises(SettingsError, match="TENSOR_PARALLEL_SIZE"):
        load_settings({"TENSOR_PARALLEL_SIZE": "0"})
