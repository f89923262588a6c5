"""Gemma 3 270M's tokenizer, built from its GGUF's SentencePiece vocabulary (262,144 pieces, no merges in the
file), against the `sentencepiece` library itself: a ModelProto is assembled here from the same vocabulary
(pieces, scores, types; BPE, byte fallback, no dummy prefix, no whitespace folding, as Gemma's
tokenizer.model is configured) and encodes with sentencepiece's own BPE. Ids, decoded text and the
streaming detokenizer's deltas are compared on a few hundred strings: test_tokenizer.py's corpus plus
Gemma's own cases (runs of spaces, tabs and newlines, which are user-defined pieces; digits; CJK; emoji;
characters with no piece, which fall back to <0xNN> bytes; its HTML tags; control-token text)."""

from __future__ import annotations

import random

import pytest
from test_tokenizer import corpus

from tinyserve.engine.loop.detokenizer import IncrementalDetokenizer
from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.model_loader import resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")  # sentencepiece's ModelProto needs it
from sentencepiece import sentencepiece_model_pb2 as model_pb2  # noqa: E402

USER_DEFINED = 4
# characters that have no piece in Gemma's vocabulary (checked below): byte fallback
NO_PIECE = "\U0010fffd\U0002fa1d\U00020000\U0002a6d6\U0001faf8\u0378\u0e7f\U00013000\U0001f004\x85\u2028\u0600\U00010000"
GEMMA_SAMPLES = [
    *(" " * n + "x" for n in range(1, 34)), *("y" + "\n" * n + "z" for n in range(1, 34)),
    "\t", "\t\t\ttabs", " \t \n \r\n mixed \u3000 ", "a \n b  \n\n  c", "trailing spaces     ", "\n",
    "0", "7 77 777 7777", "3.14159265358979", "1,234,567.89", "२०२४ ১২৩ ٤٥٦ 〇一二三", "0x1F 0b1010 1e-9",
    "東京都は日本の首都です。", "北京欢迎你", "ひらがな カタカナ", "漢字とかな混じり文", "𠀀𪚥𠮷野家",
    "😀", "👩🏽‍💻 🧑‍🤝‍🧑 🏳️‍🌈", "🇯🇵🇰🇷🇨🇳", "🫸🫷🪼🪿", "\u2764\ufe0f \u263a\ufe0e",
    *(ch for ch in NO_PIECE), NO_PIECE, f"mid{NO_PIECE[:3]}word", "\ufffd replacement", "\x00\x7f\x1b[0m",
    "<h1>Title</h1><table><tr><td>1</td></tr></table>", "<b>bold</b> <i>it</i> <code>x</code>", "[multimodal]",
    "\u2581\u2581x", "\u2581 literal lower blocks \u2581\u2581\u2581", "a\u2581b", "  \u2581  ",
    "Gemma 3 is a family of open models. It was released in 2025.", "The capital of France is",
]  # fmt: skip
# text that spells control tokens: encode() makes them control ids, text encoding must not
CONTROL_TEXT = ["<start_of_turn>user\nHi<end_of_turn>", "<bos>x<eos>", "<unused0> <unused99>", "<pad><mask>"]


def texts() -> list[str]:
    rng = random.Random(1)
    alphabet = "ab 12\t\n  \n\n東京😀" + NO_PIECE[:4] + "\u2581<>/"
    noise = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(60)]
    return [t for t in corpus() if "<|" not in t] + GEMMA_SAMPLES + noise  # "<|...|>" is SmolLM2's


@pytest.fixture(scope="module")
def gemma_reader():
    return open_gguf(resolve_model_path("gemma3-270m"))


@pytest.fixture(scope="module")
def ours(gemma_reader) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_reader)


@pytest.fixture(scope="module")
def reference(gemma_reader):
    """sentencepiece running a model assembled from the file's vocabulary. User-defined pieces get back the
    spelling of Gemma's tokenizer.model, whose whitespace runs are "\u2581\u2581..." (llama.cpp's converter
    writes them with spaces). <unk> is sentencepiece's unknown piece (llama.cpp marks it control)."""
    meta = gemma_reader.metadata
    unk = meta["tokenizer.ggml.unknown_token_id"]
    proto = model_pb2.ModelProto()
    kinds = meta["tokenizer.ggml.token_type"]
    for i, (token, score, kind) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"], kinds)):
        piece = proto.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if kind == USER_DEFINED else token
        piece.score, piece.type = score, model_pb2.ModelProto.SentencePiece.UNKNOWN if i == unk else kind
    trainer = proto.trainer_spec
    trainer.model_type, trainer.vocab_size, trainer.byte_fallback = model_pb2.TrainerSpec.BPE, len(kinds), True
    for name in ("unk", "bos", "eos", "pad"):  # sentencepiece finds them by piece, "<s>" and so on by default
        token_id = unk if name == "unk" else meta[f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id"]
        setattr(trainer, f"{name}_id", token_id)
        setattr(trainer, f"{name}_piece", meta["tokenizer.ggml.tokens"][token_id])
    normalizer = proto.normalizer_spec
    normalizer.name, normalizer.add_dummy_prefix, normalizer.remove_extra_whitespaces = "identity", False, False
    normalizer.escape_whitespaces = True
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor


def test_the_corpus_has_a_few_hundred_strings_and_exercises_byte_fallback(reference):
    assert len(set(texts())) >= 300
    byte_ids = {i for i in range(reference.get_piece_size()) if reference.is_byte(i)}
    assert all(set(reference.encode(ch)) <= byte_ids for ch in NO_PIECE)  # none of these has a piece
    user_defined = {reference.piece_to_id("\u2581" * n) for n in range(2, 31)} | {reference.piece_to_id("\n\n")}
    assert user_defined & {i for text in GEMMA_SAMPLES for i in reference.encode(text)} == user_defined


def test_ids_match_sentencepiece(ours, reference):
    mismatches = [text for text in texts() if ours.encode(text, add_special_tokens=False) != reference.encode(text)]
    assert not mismatches
    bos = reference.bos_id()
    assert all(ours.encode(text) == [bos, *reference.encode(text)] for text in GEMMA_SAMPLES)  # add_bos_token


def test_control_token_text(ours, reference):
    """Written in a prompt, control tokens become their ids (as the other vocabularies'); encoded as text, the
    path chat messages take, they are plain text: sentencepiece never makes a control piece out of text,
    and no merge may either."""
    for text in CONTROL_TEXT:
        assert ours._encode_as_text(text) == reference.encode(text), text
    assert ours.encode("<start_of_turn>user", add_special_tokens=False)[0] == reference.piece_to_id("<start_of_turn>")
    assert ours.bos_token_id == reference.bos_id() and reference.eos_id() in ours.eos_token_ids
    assert reference.piece_to_id("<end_of_turn>") in ours.eos_token_ids  # ends a turn of the instruction-tuned model


def test_decode_matches_sentencepiece(ours, reference):
    for text in texts():
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids), text
        assert ours.decode(ids) == text or "\u2581" in text, text  # a typed "\u2581" decodes as a space


def test_streamed_deltas_add_up_to_the_text(ours, reference):
    """One token at a time after a bos prompt: byte-fallback characters (2-4 byte tokens each) come out
    whole, never as U+FFFD, and the deltas add up to the text."""
    for text in texts():
        ids = reference.encode(text)
        detokenizer = IncrementalDetokenizer(ours, [reference.bos_id()])
        deltas = [detokenizer.step([i]) for i in ids] + [detokenizer.flush()]
        assert "".join(deltas) == reference.decode(ids), text
        if "\ufffd" not in text:
            assert not any("\ufffd" in delta for delta in deltas), text
