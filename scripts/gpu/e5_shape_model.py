"""A RANDOM-weight intent model of multilingual-e5-small's shape (BERT, 12 layers × 384, 12 heads, FFN 1536, the 24
intent labels) with the project's WordPiece tokenizer (MiniLM's where installed): the GPU server's latency and
throughput on a call that cannot also carry the real e5 weights (> 64 MiB). Same GPU work per token as the real
model except the embedding table's size (a gather); answers are meaningless.

    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape
"""

from __future__ import annotations

import sys
from pathlib import Path

from miaohui.models.checkpoint import ModelMeta, save_checkpoint
from miaohui.models.intent import IntentClassifier, random_bert
from miaohui.zoo.intents import LABELS
from miaohui.zoo.tiny import any_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else "var/models/intent-e5-shape")
tok = any_tokenizer()
encoder = random_bert(hidden=384, layers=12, heads=12, vocab=tok.get_vocab_size(), intermediate=1536, max_positions=512)
meta = ModelMeta(
    kind="intent",
    base="e5-small-shape-random",
    bert_config=encoder.config.to_diff_dict(),
    labels=list(LABELS),
    max_length=128,
)
print("saved", save_checkpoint(out, IntentClassifier(encoder, num_labels=len(LABELS)).eval(), meta, tok))
