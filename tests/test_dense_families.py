"""Phi-3 / Phi-4 and Gemma 3 beyond the per-family parity runs of test_model_parity and
test_engine_parity: the published configs read as transformers reads them, what is refused before
download, multimodal Gemma 3 checkpoints, longrope on both sides of its switch, chunks after cached
prefixes, prefix-cache hits, per-layer windows through the Triton kernels, and the chat templates.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from child_process import run_in_triton_interpreter
from engine import LLM, SamplingParams
from engine.attention import kv_cache_shape
from engine.config import ModelConfig
from engine.layers.rotary import compute_inv_freq
from engine.model_support import check_model_config
from engine.models import load_model
from engine.tokenizer import Tokenizer
from tiny_models import (
    PagedSeq,
    add_char_tokenizer,
    hf_logits,
    make_step,
    make_tiny_model,
    shuffled_block_tables,
)

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "bench" / "configs"
TEMPLATES = Path(__file__).resolve().parent / "templates"
BOUND = 1e-4  # max abs logit (or log-probability) difference to HF in float32
BLOCK_SIZE = 4
NUM_BLOCKS = 48


def bench_config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (checkpoint dir, HF model), built once per module."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(family: str) -> tuple[str, torch.nn.Module]:
        if family not in built:
            path = str(tmp_path_factory.mktemp(family))
            built[family] = (path, make_tiny_model(family, path))
        return built[family]

    return get


# --- the published configs ------------------------------------------------------------------------


def test_gemma3_configs_read_as_transformers_reads_them() -> None:
    transformers = pytest.importorskip("transformers")
    for name, heads, kv_heads, head_dim, scalar in (
        ("gemma-3-4b-it", 8, 4, 256, 256),
        ("gemma-3-27b-it", 32, 16, 128, 168),
    ):
        raw = bench_config(name)
        ours = ModelConfig.from_dict(raw)
        theirs = transformers.Gemma3Config(**raw).text_config
        assert (ours.architecture, ours.family) == ("Gemma3ForConditionalGeneration", "gemma3")
        assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (heads, kv_heads, head_dim)
        assert ours.vocab_size == theirs.vocab_size == 262208
        assert ours.num_layers == theirs.num_hidden_layers
        # five local layers (window 1024), then one global, as transformers lays them out
        windows = [1024 if kind == "sliding_attention" else None for kind in theirs.layer_types]
        assert list(ours.layer_windows) == windows and windows[:6] == [1024] * 5 + [None]
        assert ours.attn_scale == pytest.approx(scalar**-0.5)
        assert ours.embed_scale == pytest.approx(math.sqrt(theirs.hidden_size))
        full, local = (
            theirs.rope_parameters["full_attention"],
            theirs.rope_parameters["sliding_attention"],
        )
        assert (
            (ours.rope.rope_type, ours.rope.factor)
            == ("linear", 8.0)
            == (
                full["rope_type"],
                full["factor"],
            )
        )
        assert ours.rope.theta == full["rope_theta"] == 1e6
        assert ours.local_rope.theta == local["rope_theta"] == 1e4
        assert ours.local_rope.rope_type == local["rope_type"] == "default"
        assert ours.eos_token_ids == (1, 106)
        assert ours.tie_word_embeddings and ours.gemma_norms
        assert ours.hidden_act == "gelu_pytorch_tanh"


def test_phi4_configs_read_as_transformers_reads_them() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    mini = bench_config("phi-4-mini-instruct")
    ours = ModelConfig.from_dict(mini)
    theirs = transformers.Phi3Config(**mini)
    assert (ours.family, ours.head_dim, ours.rotary_dim) == ("phi3", 128, 96)
    assert ours.rope.rope_type == "longrope"
    assert ours.rope.original_max_position_embeddings == 4096
    # the long factors and attention factor transformers computes for a context past 4096
    long_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu", seq_len=8192)
    assert ours.rope.attention_factor == pytest.approx(scale, rel=1e-12)
    mine = compute_inv_freq(96, ours.rope, ours.max_position_embeddings)
    torch.testing.assert_close(mine, long_freq, rtol=1e-6, atol=0)
    short_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu", seq_len=100)
    short_served = ours.serving(4096)
    torch.testing.assert_close(
        compute_inv_freq(96, short_served.rope, ours.max_position_embeddings),
        short_freq,
        rtol=1e-6,
        atol=0,
    )
    # its window (262144) passes max_position_embeddings: nothing to mask
    assert ours.window_of(0) is None and ours.tie_word_embeddings

    phi4 = ModelConfig.from_dict(bench_config("phi-4"))
    assert (phi4.rope.rope_type, phi4.rope.theta, phi4.rotary_dim) == ("default", 250000.0, None)
    assert (phi4.num_heads, phi4.num_kv_heads, phi4.head_dim) == (40, 10, 128)
    assert phi4.window_of(0) is None and not phi4.tie_word_embeddings


def _edited(name: str, path: str, value) -> dict:
    """A bench config with the field at `path` ("text_config.x" nests) set to `value`."""
    cfg = bench_config(name)
    *outer, last = path.split(".")
    target = cfg
    for key in outer:
        target = target[key]
    target[last] = value
    return cfg


@pytest.mark.parametrize(
    "name, path, value, field",
    [
        ("gemma-3-4b-it", "text_config.final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("gemma-3-4b-it", "text_config.attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        (
            "gemma-3-4b-it",
            "text_config.use_bidirectional_attention",
            True,
            "use_bidirectional_attention",
        ),
        ("gemma-3-4b-it", "text_config.hidden_activation", "relu", "hidden_activation"),
        ("gemma-3-4b-it", "text_config.layer_types", ["full_attention"], "layer_types"),
        ("gemma-3-4b-it", "text_config", None, "text_config"),
        ("gemma-3-27b-it", "quantization_config", {"quant_method": "gptq"}, "quant_method"),
        ("phi-4-mini-instruct", "rope_scaling.type", "yarn", "rope type 'yarn'"),
        ("phi-4-mini-instruct", "rope_scaling.short_factor", [1.0] * 64, "short_factor"),
        ("phi-4-mini-instruct", "partial_rotary_factor", 0.2, "partial_rotary_factor"),
        ("phi-4-mini-instruct", "original_max_position_embeddings", None, "original_max"),
        ("phi-4", "hidden_act", "gelu", "hidden_act"),
        ("gemma-3-4b-it", "text_config.attention_bias", True, "attention_bias"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_field(name, path, value, field) -> None:
    cfg = _edited(name, path, value)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(cfg)


def test_the_cache_check_accepts_the_published_configs() -> None:
    """engine.model_support's answer before download, for every new config of bench/configs."""
    for name, arch in (
        ("phi-4", "Phi3ForCausalLM"),
        ("phi-4-mini-instruct", "Phi3ForCausalLM"),
        ("gemma-3-4b-it", "Gemma3ForConditionalGeneration"),
        ("gemma-3-27b-it", "Gemma3ForConditionalGeneration"),
    ):
        assert check_model_config(bench_config(name))[0] == arch


# --- checkpoints ---------------------------------------------------------------------------------


def _prefill_then_decode(model, cfg: ModelConfig, toks: list[int], prompt_len: int):
    kv = torch.zeros(
        kv_cache_shape(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    )
    seq = PagedSeq(toks, shuffled_block_tables([len(toks)], BLOCK_SIZE, NUM_BLOCKS)[0])
    out = []
    for n in [prompt_len] + [1] * (len(toks) - prompt_len):
        ids, positions, meta = make_step([seq], [n], BLOCK_SIZE)
        with torch.inference_mode():
            out.append(model.compute_logits(model(ids, positions, kv, meta)))
    return torch.cat(out)


@pytest.mark.parametrize(
    "text_prefix, vision_name",
    [
        ("language_model.model.", "vision_tower.vision_model.embeddings.patch_embedding.weight"),
        ("model.language_model.", "model.vision_tower.embeddings.patch_embedding.weight"),
    ],
)
def test_multimodal_gemma3_checkpoint_runs_its_text_decoder(
    tiny, tmp_path, text_prefix, vision_name
) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (nested text_config, prefixed text tensors, a
    vision tower the engine leaves alone) gives the text-only model's logits."""
    src, hf = tiny("gemma3")
    dest = tmp_path / "mm"
    shutil.copytree(src, dest)
    text = json.loads((dest / "config.json").read_text())
    text.pop("architectures")
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"},
        "eos_token_id": [2, 5],
    }
    (dest / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dest / "model.safetensors"))
    renamed = {text_prefix + k.removeprefix("model."): v for k, v in tensors.items()}
    renamed[vision_name] = torch.zeros(4, 3, 2, 2)
    renamed["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    save_file(renamed, str(dest / "model.safetensors"), metadata={"format": "pt"})

    cfg = ModelConfig.from_dir(str(dest))
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.eos_token_ids == (2, 5)
    model = load_model(str(dest), cfg, torch.float32, "cpu", load_format="safetensors")
    toks = tokens(30, seed=3)
    ref = hf_logits(hf, toks)
    assert (_prefill_then_decode(model, cfg, toks, 18) - ref).abs().max().item() < BOUND


def test_vision_tensors_are_unexpected_in_a_text_only_checkpoint(tiny, tmp_path) -> None:
    src, _ = tiny("gemma3")
    dest = tmp_path / "ckpt"
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.zeros(4)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(str(dest))
    with pytest.raises(ValueError, match="unexpected tensors.*vision_tower"):
        load_model(str(dest), cfg, torch.float32, "cpu", load_format="safetensors")


def test_phi3_short_factors_below_the_switch(tiny) -> None:
    """An engine serving at most original_max_position_embeddings (16) tokens rotates with the
    short factors, as HF does for sequences that short; the long ones would differ."""
    path, hf = tiny("phi3")
    cfg = ModelConfig.from_dir(path)
    toks = tokens(16, seed=4)
    ref = hf_logits(hf, toks)
    served_short = cfg.serving(16)
    model = load_model(path, served_short, torch.float32, "cpu", load_format="safetensors")
    assert (_prefill_then_decode(model, served_short, toks, 9) - ref).abs().max().item() < BOUND
    long_model = load_model(path, cfg, torch.float32, "cpu", load_format="safetensors")
    assert (_prefill_then_decode(long_model, cfg, toks, 9) - ref).abs().max().item() > 1e-2


def _engine(path: str, **kwargs) -> LLM:
    llm = LLM(
        model=path,
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        **kwargs,
    )
    llm.engine.runner.kv_cache.fill_(float("nan"))  # never-written memory must never leak
    return llm


def _assert_greedy_matches_hf(hf, prompt: list[int], out, family: str) -> None:
    gen = out.outputs[0].token_ids
    ref = torch.log_softmax(hf_logits(hf, prompt + gen), dim=-1)
    for s, pos in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + s]
        for token_id, lp in pos.items():
            assert abs(lp.logprob - row[token_id].item()) < BOUND, (family, s)
        assert row[gen[s]].item() >= row.max().item() - BOUND


def test_engine_below_the_longrope_switch_matches_hf(tiny) -> None:
    """max_model_len 16 = original_max_position_embeddings: the engine serves the short factors."""
    path, hf = tiny("phi3")
    llm = _engine(path, max_model_len=16)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=3)
    prompt = tokens(7, seed=5)
    _assert_greedy_matches_hf(hf, prompt, llm.generate([prompt], params)[0], "phi3")


@pytest.mark.parametrize("family", ["phi3", "gemma3", "gemma2", "qwen2-window"])
def test_prefix_cache_hits_match_hf(tiny, family: str) -> None:
    """A second prompt sharing a cached 24-token prefix (past the window of 8, past longrope's
    switch at 16) reads it from the cache and still gives HF's log-probabilities."""
    path, hf = tiny(family)
    llm = _engine(path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    first = tokens(30, seed=6)
    second = first[:24] + tokens(9, seed=7)
    out_first = llm.generate([first], params)[0]
    out_second = llm.generate([second], params)[0]
    assert out_second.num_cached_tokens >= 20
    _assert_greedy_matches_hf(hf, first, out_first, family)
    _assert_greedy_matches_hf(hf, second, out_second, family)


@pytest.mark.parametrize("family", ["phi3", "gemma3", "gemma2", "qwen2-window"])
def test_chunk_after_cached_prefix_and_decode_in_one_step(tiny, family: str) -> None:
    """One step holding a prefill chunk after 18 cached tokens and another sequence's decode gives
    HF's logits for both (the rows cross the window of 8 and longrope's switch at 16)."""
    path, hf = tiny(family)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, "cpu", load_format="safetensors")
    a_toks, b_toks = tokens(30, seed=8), tokens(22, seed=9)
    tables = shuffled_block_tables([30, 22], BLOCK_SIZE, NUM_BLOCKS, seed=10)
    a, b = PagedSeq(a_toks, tables[0]), PagedSeq(b_toks, tables[1])
    kv = torch.zeros(
        kv_cache_shape(cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    )
    with torch.inference_mode():
        for seqs, sizes in (([a], [18]), ([b], [21])):
            ids, positions, meta = make_step(seqs, sizes, BLOCK_SIZE)
            model(ids, positions, kv, meta)
        ids, positions, meta = make_step([a, b], [12, 1], BLOCK_SIZE)
        together = model.compute_logits(model(ids, positions, kv, meta))
    assert (together[:12] - hf_logits(hf, a_toks)[18:]).abs().max().item() < BOUND
    assert (together[12:] - hf_logits(hf, b_toks)[21:]).abs().max().item() < BOUND


# --- per-layer windows through the Triton kernels (interpreter) ----------------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None

# run by tests/child_process.run_in_triton_interpreter
INTERPRETER_SCRIPT = """
import sys
import torch
from engine.attention.triton_attn import TritonAttentionBackend
from engine.config import ModelConfig
from engine.models import load_model
from test_dense_families import _prefill_then_decode, tokens
from tiny_models import hf_logits, make_tiny_model

worst = 0.0
for family in ("gemma3", "gemma2"):  # gemma2: soft-capped scores too
    path = f"{sys.argv[1]}/{family}"
    hf = make_tiny_model(family, path)
    cfg = ModelConfig.from_dir(path)
    assert len(set(cfg.layer_windows)) == 2, cfg.layer_windows  # windowed and global layers
    backend = TritonAttentionBackend(programs_per_sm=16)
    model = load_model(path, cfg, torch.float32, "cpu", backend, load_format="safetensors")
    toks = tokens(20, seed=11)
    err = (_prefill_then_decode(model, cfg, toks, 14) - hf_logits(hf, toks)).abs().max().item()
    assert err < 1e-4, (family, err)
    worst = max(worst, err)
print("ok", worst)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gemma_windows_through_the_triton_kernels_in_the_interpreter(tmp_path) -> None:
    """The Triton attention kernels, run by triton's CPU interpreter, honour each layer's own
    window (local layers window 8, global ones none) in a tiny Gemma 3 and a tiny Gemma 2 (whose
    scores are soft-capped too) against HF."""
    done = run_in_triton_interpreter(textwrap.dedent(INTERPRETER_SCRIPT), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("ok")


# --- chat templates -------------------------------------------------------------------------------

# The published templates (tokenizer_config.json of google/gemma-3-4b-it, microsoft/phi-4,
# microsoft/Phi-4-mini-instruct), rendered by our renderer and by transformers.
CHAT_TEMPLATES = ("gemma3", "phi4", "phi4_mini")
CONVERSATIONS = [
    [{"role": "user", "content": "  Hello there \n"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Describe the moon."}]},
    ],
]


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory):
    """(ours, transformers') for a small tokenizer whose bos / eos are Gemma's."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("chat")
    add_char_tokenizer(str(path))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", eos_token="</s>")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("template_name", CHAT_TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_as_transformers(
    chat_tokenizers, template_name: str, add_generation_prompt: bool
) -> None:
    ours, theirs = chat_tokenizers
    template = (TEMPLATES / f"{template_name}.jinja").read_text()
    for messages in CONVERSATIONS:
        if template_name != "gemma3" and not isinstance(messages[-1]["content"], str):
            continue  # the Phi templates concatenate string content only
        expected = theirs.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        got = ours.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt
        )
        assert got == expected
    gemma = ours.apply_chat_template(
        CONVERSATIONS[1], chat_template=(TEMPLATES / "gemma3.jinja").read_text()
    )
    assert gemma.startswith("<s><start_of_turn>user\nAnswer briefly.\n\nWhat is 2 + 2?")


def test_gemma3_template_refuses_roles_out_of_turn(chat_tokenizers) -> None:
    ours, _ = chat_tokenizers
    template = (TEMPLATES / "gemma3.jinja").read_text()
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            chat_template=template,
        )


def test_windows_and_local_rope_change_the_result(tiny) -> None:
    """The switches are live: Gemma 3 without its windows, or without its local rope, no longer
    matches HF (so the parity runs above test them)."""
    path, hf = tiny("gemma3")
    cfg = ModelConfig.from_dir(path)
    toks = tokens(24, seed=12)
    ref = hf_logits(hf, toks)
    for changed in (
        dataclasses.replace(cfg, layer_windows=(None,) * cfg.num_layers),
        dataclasses.replace(cfg, local_rope=None),
    ):
        model = load_model(path, changed, torch.float32, "cpu", load_format="safetensors")
        assert (_prefill_then_decode(model, changed, toks, 12) - ref).abs().max().item() > 1e-2


def test_gemma3_local_layers_keep_their_rope_when_the_window_masks_nothing(tmp_path) -> None:
    """A window past max_position_embeddings (200 > 128) masks nothing and is dropped, yet the local
    layers still rotate with their own base, as HF's do."""
    hf = make_tiny_model("gemma3", str(tmp_path), sliding_window=200)
    cfg = ModelConfig.from_dir(str(tmp_path))
    assert cfg.layer_windows == (None,) * 4 and cfg.local_layers == (0, 2)
    model = load_model(str(tmp_path), cfg, torch.float32, "cpu", load_format="safetensors")
    toks = tokens(20, seed=13)
    assert (
        _prefill_then_decode(model, cfg, toks, 12) - hf_logits(hf, toks)
    ).abs().max().item() < BOUND


def test_gemma2_soft_caps_change_the_result(tiny) -> None:
    """Gemma 2's two soft-caps are live in the tiny model (so its parity runs test them), and a
    config asking for a non-positive cap is refused naming the field."""
    path, hf = tiny("gemma2")
    cfg = ModelConfig.from_dir(path)
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.local_layers) == (1.0, 2.0, (0, 2))
    toks = tokens(24, seed=14)
    ref = hf_logits(hf, toks)
    for changed in (
        dataclasses.replace(cfg, attn_softcap=None),
        dataclasses.replace(cfg, final_softcap=None),
    ):
        model = load_model(path, changed, torch.float32, "cpu", load_format="safetensors")
        assert (_prefill_then_decode(model, changed, toks, 12) - ref).abs().max().item() > 1e-2
    raw = json.loads((Path(path) / "config.json").read_text())
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": 0})
