"""Checkpoint tensor names as the decoder template knows them: a multimodal checkpoint's text
decoder carries a prefix (`model.language_model.`, or before transformers 5
`language_model.model.`), and its vision tower and projector are not the engine's.

No torch: the weight reader asks it for every tensor name it meets.
"""

from __future__ import annotations

# prefix in the checkpoint -> the text-only checkpoint's prefix
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# tensors of a multimodal checkpoint outside its text decoder
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_decoder_name(name: str) -> str:
    """`name` with a multimodal checkpoint's text-decoder prefix replaced by the text-only one."""
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return name


def is_vision_tensor(name: str) -> bool:
    """True for a multimodal checkpoint's vision tower and projector tensors."""
    return name.startswith(_VISION_PREFIXES)
