"""Keeps credentials out of log lines: a filter on the loggers of our cache and of the clients it
drives.

`hide_secrets(...)` registers values (tokens, keys); any record whose text holds one is rewritten
with it masked.
"""

from __future__ import annotations

import logging
from typing import Any

# Loggers whose records may carry request headers or URLs (botocore logs signed headers at DEBUG).
_WATCHED_PREFIXES = (
    "cache",
    "botocore",
    "boto3",
    "s3transfer",
    "urllib3",
    "huggingface_hub",
    "httpx",
    "httpcore",
    "filelock",
)
_MASK = "***"


def secret_value(value: Any) -> str | None:
    """The plain text of a secret given as str or as a pydantic SecretStr; None stays None."""
    if value is None:
        return None
    getter = getattr(value, "get_secret_value", None)
    return getter() if callable(getter) else str(value)


class _Redactor(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def mask(self, text: str) -> str:
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, _MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is left for logging itself to report
            return True
        masked = self.mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            masked_exc = self.mask(text)
            if masked_exc != text:
                record.exc_info, record.exc_text = None, masked_exc
        return True


_REDACTOR = _Redactor()


def mask(text: str) -> str:
    """text with every registered secret masked (for error messages built from third-party
    exceptions)."""
    return _REDACTOR.mask(text)


def hide_secrets(*values: Any) -> None:
    """Register secrets (empty and very short values are ignored) and attach the filter to every
    watched logger that exists now; call it again after importing a client library so its new
    loggers are covered."""
    for value in values:
        text = secret_value(value)
        if text and len(text) >= 6:
            _REDACTOR.secrets.add(text)
    if not _REDACTOR.secrets:
        return
    names = [
        n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in _WATCHED_PREFIXES
    ]
    for name in names + list(_WATCHED_PREFIXES):
        logger = logging.getLogger(name)
        if _REDACTOR not in logger.filters:
            logger.addFilter(_REDACTOR)
