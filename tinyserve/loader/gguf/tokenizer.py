"""A GGUF's tokenizer metadata -> a `tokenizers.Tokenizer` backend.

A GGUF has no tokenizer.json: it lists tokens, token types, merges (or scores) and names its pre-tokenizer in
`tokenizer.ggml.pre`, whose split regexes we take from llama.cpp's definitions. Byte-level (GPT-2 style) and
SentencePiece-style vocabularies are assembled here; loader/tokenizer.py wraps the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.file_format import GGUFFile

# llama.cpp's token types (gguf.TokenType) that matter here; the others are UNKNOWN=2, UNUSED=5, BYTE=6
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, each applied to the pieces the previous one left.
# SmolLM/StarCoder vocabularies were trained with every digit on its own, hence the \p{N} split first.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "phi-2"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), (r"\p{N}", _GPT2_SPLIT)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2_SPLIT,)),
}
# Llama 3 style vocabularies take a whole pre-token that is itself a token without running merges (llama.cpp too).
_IGNORE_MERGES = {_LLAMA3_SPLIT}


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What a GGUF says about its tokenizer, with the backend built (no post-processor yet)."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_gguf_tokenizer(reader: GGUFFile) -> GGUFTokenizerParts:
    model = reader.metadata.get("tokenizer.ggml.model")
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ModelLoadError(f"{reader.path}: no tokenizer metadata (tokenizer.ggml.model and tokenizer.ggml.tokens)")
    if model not in ("gpt2", "llama"):
        raise ModelLoadError(f"unsupported GGUF tokenizer.ggml.model={model!r}; supported: 'gpt2', 'llama'")

    def token(key: str) -> str | None:
        token_id = reader.metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    types = list(reader.metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in reader.metadata.get("tokenizer.ggml.merges", [])]
    if model == "gpt2":
        backend = _byte_level_backend(reader, tokens, types, merges)
        _add_gguf_special_tokens(backend, tokens, types)
    else:
        tokens = _sentencepiece_spelling(tokens, types)
        backend = _sentencepiece_backend(reader, tokens, types, merges, token("unknown"))
        _add_gguf_special_tokens(backend, tokens, types, user_defined_normalized=True)
    return GGUFTokenizerParts(
        backend, bos_token=token("bos"), eos_token=token("eos"),
        # llama.cpp adds bos to a SentencePiece vocabulary unless the file says otherwise
        add_bos=reader.metadata.get("tokenizer.ggml.add_bos_token", model == "llama"),
        add_eos=reader.metadata.get("tokenizer.ggml.add_eos_token", False),
        chat_template=reader.metadata.get("tokenizer.chat_template"),
    )


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest move to U+0100 on."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(0x100 + shifted)
            shifted += 1
    return mapping


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """A GGUF spells byte-level tokens in GPT-2's alphabet, but control and user-defined tokens as raw text;
    raw ones stay raw (they are matched whole in the text), any other odd one is respelled byte by byte."""
    spelling = gpt2_byte_alphabet()
    # a token all in the alphabet: one regex match (a set of its characters per token was 0.1 s of a 128K vocab)
    spelled = re.compile("[" + re.escape("".join(sorted(set(spelling.values())))) + "]*").fullmatch
    vocab: dict[str, int] = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, types)):
        if token_type not in (_CONTROL, _USER_DEFINED) and spelled(token) is None:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, token_id)
    return vocab


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges a pair into the piece with the best score; as merge rules that is every split
    of a token into two tokens, ranked by the token's score (ties: longer left part, then file order). Only
    normal pieces are merge results: SentencePiece never makes a control, byte or user-defined piece out of
    text ("<unused0>" typed in a prompt stays text), and their splits are a third of the work in Gemma's."""
    index = set(tokens)
    ranked = []
    for merged_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _NORMAL:  # one comprehension per token: this loop sees 1.6M cuts in Gemma's vocabulary
            score, n = -scores[merged_id], len(token)
            ranked += [(score, -cut, cut - n, merged_id, token[:cut], token[cut:])
                       for cut in range(1, n) if token[:cut] in index and token[cut:] in index]
    ranked.sort()  # NOTE: the first four fields decide, and (score, merged_id) is unique: left/right never compared
    return [(left, right) for *_, left, right in ranked]


def _byte_level_backend(reader: GGUFFile, tokens: list[str], types: list[int], merges: list) -> tokenizers.Tokenizer:
    pre = reader.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ModelLoadError(f"unsupported GGUF tokenizer.ggml.pre={pre!r}; supported: {sorted(_PRE_SPLITS)}")
    splits = _PRE_SPLITS[pre]
    vocab = _byte_level_vocab(tokens, types)
    backend = tokenizers.Tokenizer(BPE(vocab, merges, ignore_merges=bool(_IGNORE_MERGES & set(splits))))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_spelling(tokens: list[str], types: list[int]) -> list[str]:
    """llama.cpp's converter writes the spaces of user-defined pieces as " " (it matches them in the raw text:
    Gemma's whitespace runs "  ", "   ", ...); SentencePiece spells them "\u2581" and matches them in the
    normalized text, where a typed "\u2581" counts as a space too. The SentencePiece spelling is put back."""
    return [t.replace(" ", "\u2581") if kind == _USER_DEFINED else t for t, kind in zip(tokens, types)]


def _sentencepiece_backend(
    reader: GGUFFile, tokens: list[str], types: list[int], merges: list, unk: str | None
) -> tokenizers.Tokenizer:
    """SentencePiece pieces spell spaces as "\u2581"; <0xNN> byte tokens cover whatever has no piece (else unk)."""
    if not merges:
        scores = reader.metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_scores(tokens, scores, types)
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    backend = tokenizers.Tokenizer(BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
    has_prefix = bool(reader.metadata.get("tokenizer.ggml.add_space_prefix", True))
    # NOTE: a normalizer, not Metaspace: a space is prepended even to text that starts with one, and again after
    # each special token, as sentencepiece, llama.cpp and Llama 2's own tokenizer.json do.
    spaces = [normalizers.Prepend("\u2581")] if has_prefix else []
    backend.normalizer = normalizers.Sequence(spaces + [normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if has_prefix else []))
    return backend


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], user_defined_normalized: bool = False
) -> None:
    """Control tokens become special (skipped by decode), user-defined ones plain added tokens; both are then
    matched whole in the text instead of being cut into pieces. Control tokens are matched in the raw text,
    user-defined ones in the normalized text where the vocabulary is SentencePiece's (as sentencepiece does)."""
    added = [(token, kind) for token, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in added if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=user_defined_normalized)
                        for t, k in added if k == _USER_DEFINED])
