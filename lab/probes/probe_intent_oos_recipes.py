"""Out-of-scope recipes on the small-data bench's label sets, compared on saved logits.

``train DOMAIN PER_LABEL NEGATIVES``: trains one point of ``benchmarks/bench_intent_small_data.py`` (same split, same
``--oos-data`` sets) and saves the logits of its dev, test, held-out chit-chat and held-back negative texts with the
fitted temperature to ``OUT/DOMAIN-PER_LABEL-NEGATIVES.npz``. ``rules``: for every saved file, the energy score's
threshold by three rules (the 97 % dev-recall point, the lowest in-domain dev score, and halfway between the lowest
in-domain dev score and the highest negative one, never above the first), with test accuracy, accuracy with the
decision and the held-out chit-chat rejected; then the bench's score table (max softmax / energy / margin at
95 / 97 / 99 % recall). Training needs no network; one point takes about a minute on a quiet 2-core machine.

    python lab/probes/probe_intent_oos_recipes.py train shop 32 tune --out /tmp/oos
    python lab/probes/probe_intent_oos_recipes.py rules --out /tmp/oos
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_intent_small_data as bench
from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.decision import choose_threshold, oos_scores
from miaohui.models.train import TrainConfig, full_logits, train_intent
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.zoo.intents import TrainData, load_texts, load_user_jsonl


def train(domain: str, per_label: int, negatives_name: str, out: Path) -> Path:
    negatives = [t for name in bench.NEGATIVES[negatives_name] for t in load_texts(bench.DATA / name)]
    chat = load_texts(bench.DATA / "chitchat_test.jsonl")
    rows = load_user_jsonl(bench.DATA / f"{domain}.jsonl")
    pool, dev, test = bench.split(rows)
    train_rows = [r for key in sorted(pool) for r in pool[key][: per_label // 2]]
    labels = tuple(sorted({r.intent for r in rows}))
    data = TrainData(labels=labels, train=train_rows, dev=dev, source=domain, dev_source=f"{domain} dev")
    held = list(negatives)
    random.Random(TrainConfig().seed).shuffle(held)  # the fifth train_intent holds back
    held = held[: len(held) // 5] if len(held) >= 5 else []
    file = out / f"{domain}-{per_label}-{negatives_name}.npz"
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = train_intent(TrainConfig(), Path(tmp) / "m", progress=False, data=data, negatives=negatives)
        loaded = load_checkpoint(path)
        tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)

        def logits(texts: list[str]) -> np.ndarray:
            if not texts:
                return np.zeros((0, len(labels)))
            return full_logits(bench._module(loaded), tok, texts, loaded.meta.max_length).numpy()

        out.mkdir(parents=True, exist_ok=True)
        np.savez(
            file,
            dev=logits([x.text for x in dev]),
            dev_y=np.array([labels.index(x.intent) for x in dev]),
            test=logits([x.text for x in test]),
            test_y=np.array([labels.index(x.intent) for x in test]),
            chat=logits(chat),
            negdev=logits(held),
            T=loaded.meta.decision.temperature if loaded.meta.decision else 1.0,
        )
    return file


def rules(out: Path) -> None:
    for file in sorted(out.glob("*.npz")):
        d = np.load(file)
        t = float(d["T"])
        hit = d["test"].argmax(-1) == d["test_y"]
        dev, test, chat = (oos_scores(d[k], t, "energy") for k in ("dev", "test", "chat"))
        cuts = {"recall 97 %": choose_threshold(dev, 0.97), "lowest dev": float(dev.min())}
        if len(d["negdev"]):
            neg = oos_scores(d["negdev"], t, "energy")
            cuts["midpoint"] = min(cuts["recall 97 %"], (float(dev.min()) + float(neg.max())) / 2)
        print(f"{file.stem}: temperature {t:.3f}, test accuracy {hit.mean():.1%}")
        for name, cut in cuts.items():
            kept = test >= cut
            print(
                f"  energy, {name:12s} threshold {cut:6.2f}: with decision {(hit & kept).mean():.1%}, "
                f"chit-chat rejected {(chat < cut).mean():.1%}"
            )
        table = bench.compare_scores((d["dev"], d["dev_y"]), (d["test"], d["test_y"]), d["chat"], t)
        print(
            "  "
            + "  ".join(
                f"{r['score']}@{r['target_recall']}: {r['test_accuracy_with_oos']:.1%}/{r['chitchat_rejected']:.1%}"
                for r in table
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["train", "rules"])
    ap.add_argument("domain", nargs="?", default="shop")
    ap.add_argument("per_label", nargs="?", type=int, default=32)
    ap.add_argument("negatives", nargs="?", default="tune", choices=sorted(bench.NEGATIVES))
    ap.add_argument("--out", type=Path, default=Path("/tmp/intent-oos-recipes"))
    args = ap.parse_args()
    if args.what == "train":
        print(train(args.domain, args.per_label, args.negatives, args.out))
    else:
        rules(args.out)


if __name__ == "__main__":
    main()
