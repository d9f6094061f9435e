"""The background engine boot: one readiness every caller awaits, load errors that name MODEL_NAME,
served names, and a waiter that gives up never cancelling the load for the others.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from cache import start_pages
from handler.config import load_settings
from handler.engine_boot import EngineBoot, ModelLoadError


def test_a_missing_model_fails_readiness_with_a_message_naming_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    boot = EngineBoot(
        load_settings(
            {
                "MODEL_NAME": missing,
                "CACHE_DIR": str(tmp_path / "cache"),
                "BASE_PATH": str(tmp_path / "volume"),
                "DEVICE": "cpu",
            }
        )
    )

    async def wait():
        return await boot.ready()

    with pytest.raises(ModelLoadError) as err:
        asyncio.run(wait())
    assert "MODEL_NAME" in str(err.value) and missing in str(err.value)
    assert boot.failed is err.value and not boot.is_ready and boot.engine_now() is None


def test_ready_serves_every_waiter_and_survives_a_cancelled_one(smollm2_dir, tmp_path):
    settings = load_settings(
        {
            "MODEL_NAME": smollm2_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "demo",
            "MAX_MODEL_LEN": "256",
            "DEVICE": "cpu",
            "CACHE_DIR": str(tmp_path),
        }
    )
    boot = EngineBoot(settings)
    assert boot.served_names == ["demo", smollm2_dir]  # known before loading
    assert boot.tokenizer is None and not boot.is_ready

    async def main():
        impatient = asyncio.ensure_future(boot.ready())
        await asyncio.sleep(0)
        impatient.cancel()  # one waiter gives up: the load goes on for the others
        engines = await asyncio.gather(boot.ready(), boot.ready())
        return impatient, engines

    impatient, (first, second) = asyncio.run(main())
    try:
        assert impatient.cancelled() and first is second and boot.is_ready
        assert boot.tokenizer is first.tokenizer and boot.tokenizer is not None
        assert boot.model_dir is not None and str(boot.model_dir) in boot.served_names
        assert {"resolve", "stream_start", "engine", "total"} <= set(boot.phases)
        assert boot.weight_stream == "prefetch"  # no GPU: the page cache is filled, not a device
        assert first.engine.max_model_len == 256
        # recorded once the engine is up, for later starts
        pages = Path(start_pages.default_path(str(tmp_path)))
        deadline = time.monotonic() + 30
        while not pages.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("tokenizers" in name for name, _ in json.loads(pages.read_text())["files"])
    finally:
        first.shutdown()


def test_a_tokenizer_that_does_not_resolve_is_named_as_tokenizer_name(smollm2_dir, tmp_path):
    missing = str(tmp_path / "no-such-tokenizer")
    boot = EngineBoot(
        load_settings(
            {
                "MODEL_NAME": smollm2_dir,
                "TOKENIZER_NAME": missing,
                "DEVICE": "cpu",
                "CACHE_DIR": str(tmp_path / "cache"),
            }
        )
    )
    wanted = r"^TOKENIZER_NAME=.*no-such-tokenizer.*could not resolve the tokenizer"
    with pytest.raises(ModelLoadError, match=wanted):
        boot.load_blocking()
    assert str(boot.model_dir) == smollm2_dir  # the model itself resolved first
