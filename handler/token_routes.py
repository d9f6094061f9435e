"""vLLM's /tokenize and /detokenize: a prompt or a conversation (rendered as /v1/chat/completions
renders it) to token ids, and token ids back to text."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from handler.engine_requests import (
    CHAT_ROUTE,
    DETOKENIZE_ROUTE,
    RequestBuilder,
    check_depth,
    parse_body,
)
from handler.protocol import (
    ApiError,
    DetokenizeRequest,
    TokenizeRequest,
    describe_validation_error,
)


def _parsed(schema, body: Any):
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
    check_depth(body)
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        param, message = describe_validation_error(e.errors())
        raise ApiError(400, message, param) from None


class TokenRoutes:
    """answer(route, body) for /tokenize and /detokenize, with the model's tokenizer and limits."""

    def __init__(self, requests: RequestBuilder, max_model_len: int):
        self.requests = requests
        self.tokenizer = requests.tokenizer
        self.max_model_len = max_model_len

    async def answer(self, route: str, body: Any) -> dict:
        if route == DETOKENIZE_ROUTE:
            return await self._detokenize(_parsed(DetokenizeRequest, body))
        return await self._tokenize(_parsed(TokenizeRequest, body), body)

    async def _tokenize(self, req: TokenizeRequest, body: dict) -> dict:
        self.requests.model(req.model)
        if req.prompt is not None:
            self.requests.check_chars(len(req.prompt), "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, special)
        else:
            chat_fields = ("messages", "add_generation_prompt", "continue_final_message")
            chat_body = {
                k: body[k] for k in (*chat_fields, "chat_template_kwargs", "tools") if k in body
            }
            chat = parse_body(CHAT_ROUTE, chat_body)
            tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
            text = await asyncio.to_thread(self.requests.render_chat, chat, tools)
            # the template writes the special tokens itself (as for a chat request)
            special = bool(req.add_special_tokens)
            ids = await asyncio.to_thread(self.tokenizer.encode, text, special)
        strs = [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def _detokenize(self, req: DetokenizeRequest) -> dict:
        self.requests.model(req.model)
        vocab = self.requests.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token ids must be in [0, {vocab}), got {bad}", "tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens, False)
        return {"prompt": text}
