"""The Llama-3 tokenizer (128,256 tokens) as a `tokenizers` tokenizer, for the grammar benchmarks.

Built from Meta's tiktoken rank file as the `llama-models` wheel ships it
(llama_models/llama3/tokenizer.model): byte-level BPE with Llama 3's split pattern and its 256
special tokens. `python -m bench.grammar_tokenizer OUT` writes it as tokenizer.json so a machine
without the wheel (the GPU machine) can be handed the file.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# Llama 3's pre-tokenizer split (llama_models/llama3/tokenizer.py, `pat_str`).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The named special tokens, in id order after the 128,000 ranks; the rest of the 256 are reserved
# ones.
LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
NUM_SPECIALS = 256


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes as themselves, others past U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken rank file: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair byte-pair encoding joins last when it builds `token`: merge the lowest-ranked
    adjacent pair, using only ranks below the token's own, until two parts remain. None for the few
    tokens no such path builds (tiktoken, like `ignore_merges`, still finds them when a whole
    pre-tokenized word equals one)."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def llama3_tokenizer(rank_file: str) -> Tokenizer:
    """The Llama-3 tokenizer from its rank file: 128,000 BPE tokens plus 256 special tokens."""
    ranks = read_ranks(rank_file)
    chars = byte_to_char()

    def spell(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    pairs = [
        _last_merge(token, ranks)
        for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(token) > 1
    ]
    merges = [(spell(a), spell(b)) for a, b in filter(None, pairs)]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = list(LLAMA3_NAMED_SPECIALS)
    specials += [
        f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIALS - len(specials))
    ]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def installed_rank_file() -> str | None:
    """llama_models/llama3/tokenizer.model of the installed `llama-models` wheel, if any."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "llama3", "tokenizer.model")
    return path if os.path.isfile(path) else None


def load_bench_tokenizer(path: str | None) -> tuple[Tokenizer, str]:
    """The benchmark's tokenizer and where it came from: a tokenizer.json (or a directory holding
    one), a tiktoken rank file, or the installed llama-models wheel's Llama-3 ranks."""
    if path is None:
        path = installed_rank_file()
        if path is None:
            raise SystemExit(
                "no tokenizer: pass --tokenizer (tokenizer.json, a model dir or a Llama-3 "
                "tokenizer.model) or install llama-models (pip install --no-deps llama-models)"
            )
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if path.endswith(".json"):
        return Tokenizer.from_file(path), path
    return llama3_tokenizer(path), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", help="where to write tokenizer.json")
    parser.add_argument(
        "--ranks", default=None, help="a Llama-3 tokenizer.model (default: llama-models')"
    )
    args = parser.parse_args()
    tok, source = load_bench_tokenizer(args.ranks)
    tok.save(args.out)
    print(f"{args.out}: {tok.get_vocab_size()} tokens from {source}")


if __name__ == "__main__":
    main()
