"""Accuracy of ``train-intent`` on label sets of your own with few examples a label, and its out-of-scope rejection.

Two domains of six labels each that the project's data does not have (an online shop's and an airline's customer
service), 80 hand-written utterances a label, half Chinese and half English
(``benchmarks/data/own_intents/{shop,travel}.jsonl``). From each label and language, drawn with seed 0: 5 test, 3 dev,
the other 32 the training pool; a run trains on the first 4 / 8 / 16 / 32 of each language (8 / 16 / 32 / 64 a label)
with the dev rows as ``--dev``. Off-topic chit-chat (``chitchat_tune.jsonl``, 60 texts) is given as ``--oos-data``;
``chitchat_test.jsonl`` (60 other texts) is never trained or tuned on and measures rejection.

Per run: test accuracy (best label), in-domain accuracy with the out-of-scope decision (an in-domain text answered out
of scope counts as wrong), the share of the held-out chit-chat answered out of scope, and dev calibration error before
and after temperature scaling, all with the decision ``train-intent`` ships (its defaults); ``scores`` adds the three
scores below at three target recalls (dev thresholds without the midpoint rule). ``--baseline`` adds, at 32 a label,
the recipe before step floors (8 epochs, no best-on-dev choice: ``min_steps=0, evaluations=1``) and the recipe without
negatives.

    .venv/bin/python benchmarks/bench_intent_small_data.py [--sizes 8 16 32 64] [--compare-negatives] \
        [--baseline] [--project]

``--project`` also trains the project's 24-label model with the default recipe and measures it on its dev split,
and the chit-chat test texts (a few CPU minutes more).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from miaohui.bench.report import git_commit
from miaohui.models.checkpoint import load_checkpoint
from miaohui.models.decision import decide, softmax
from miaohui.models.intent import IntentClassifier
from miaohui.models.train import TrainConfig, full_logits, train_intent
from miaohui.nlp.tokenizer import TextTokenizer
from miaohui.zoo.intents import LabelledText, TrainData, load_texts, load_user_jsonl

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data" / "own_intents"
RESULTS = ROOT / "results"
DOMAINS = ("shop", "travel")
TEST, DEV = 5, 3
NEGATIVES = {
    "none": (),
    "tune": ("chitchat_tune.jsonl",),
    "tune+more": ("chitchat_tune.jsonl", "chitchat_more.jsonl"),
}
"""``--negatives``: the chit-chat files given as ``--oos-data`` (never ``chitchat_test.jsonl``)."""


def _module(loaded: Any) -> IntentClassifier:
    """A loaded intent checkpoint's module (``load_checkpoint`` types it as a plain module)."""
    return cast(IntentClassifier, loaded.module)


def split(
    rows: list[LabelledText],
) -> tuple[dict[tuple[str, str], list[LabelledText]], list[LabelledText], list[LabelledText]]:
    """(training pool by (label, lang), dev, test), drawn with seed 0."""
    rng = random.Random(0)
    groups: dict[tuple[str, str], list[LabelledText]] = {}
    for r in rows:
        groups.setdefault((r.intent, r.lang or ""), []).append(r)
    pool, dev, test = {}, [], []
    for key in sorted(groups):
        g = list(groups[key])
        rng.shuffle(g)
        test += g[:TEST]
        dev += g[TEST : TEST + DEV]
        pool[key] = g[TEST + DEV :]
    return pool, dev, test


SCORES = ("max_softmax", "energy", "margin")
"""Out-of-scope scores compared on the same logits (higher = more in-domain): the calibrated top probability (what
``train-intent`` ships), the energy score ``T·logsumexp(z/T)`` (Liu et al., 2020) and the margin between the two
best calibrated probabilities."""


def score(logits: np.ndarray, kind: str, temperature: float) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64) / temperature
    if kind == "energy":
        top = z.max(-1)
        return temperature * (top + np.log(np.exp(z - top[:, None]).sum(-1)))
    p = np.sort(softmax(logits, temperature), axis=-1)
    return p[:, -1] - p[:, -2] if kind == "margin" else p[:, -1]


def compare_scores(
    dev: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    chat: np.ndarray,
    temperature: float,
    recalls: tuple[float, ...] = (0.95, 0.97, 0.99),
) -> list[dict[str, Any]]:
    """Each score with its threshold fitted on dev as ``train-intent`` fits the shipped one (the highest that keeps
    ``recall`` of the in-domain dev texts): in-domain test accuracy with the decision and chit-chat rejected."""
    from miaohui.models.decision import choose_threshold

    out = []
    for kind in SCORES:
        for recall in recalls:
            cut = choose_threshold(score(dev[0], kind, temperature), recall)
            kept = score(test[0], kind, temperature) >= cut
            hit = (test[0].argmax(-1) == test[1]) & kept
            out.append(
                {
                    "score": kind,
                    "target_recall": recall,
                    "test_accuracy_with_oos": round(float(hit.mean()), 4),
                    "chitchat_rejected": round(float((score(chat, kind, temperature) < cut).mean()), 4),
                }
            )
    return out


def measure(
    model_dir: Path, test: list[LabelledText], chat: list[str], dev: list[LabelledText] | None = None
) -> dict[str, Any]:
    loaded = load_checkpoint(model_dir)
    tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
    labels, decision = loaded.meta.labels, loaded.meta.decision
    logits = full_logits(_module(loaded), tok, [x.text for x in test], loaded.meta.max_length).numpy()
    gold = [x.intent for x in test]
    best = [labels[i] for i in logits.argmax(-1)]
    answered = [d.intent for d in decide(logits, labels, decision)]
    chat_logits = full_logits(_module(loaded), tok, chat, loaded.meta.max_length).numpy()
    rejected = [d.out_of_scope for d in decide(chat_logits, labels, decision)]
    plain = softmax(chat_logits).max(-1)
    out = {
        "test_accuracy": round(float(np.mean([a == b for a, b in zip(best, gold, strict=True)])), 4),
        "test_accuracy_with_oos": round(float(np.mean([a == b for a, b in zip(answered, gold, strict=True)])), 4),
        "test_answered_oos": round(
            float(np.mean([a == (decision.oos_label if decision else "") for a in answered])), 4
        ),
        "chitchat_rejected": round(float(np.mean(rejected)), 4),
        "chitchat_mean_plain_confidence": round(float(plain.mean()), 4),
        "n_test": len(test),
        "n_chitchat": len(chat),
        "decision": decision.model_dump() if decision else None,
        "steps": loaded.meta.train.get("steps"),
        "best_step": loaded.meta.train.get("best_step"),
        "train_seconds": loaded.meta.train.get("seconds"),
        "dev_accuracy": loaded.meta.train.get("dev_accuracy"),
    }
    if dev and decision is not None and "out_of_scope" not in labels:
        dev_logits = full_logits(_module(loaded), tok, [x.text for x in dev], loaded.meta.max_length).numpy()
        dev_gold = np.array([labels.index(x.intent) for x in dev])
        test_gold = np.array([labels.index(x) for x in gold])
        scores = compare_scores((dev_logits, dev_gold), (logits, test_gold), chat_logits, decision.temperature)
        out["scores"] = scores
    return out


def run(
    domain: str, per_label: int, cfg: TrainConfig, negatives: list[str], chat: list[str], tmp: Path
) -> dict[str, Any]:
    rows = load_user_jsonl(DATA / f"{domain}.jsonl")
    pool, dev, test = split(rows)
    train = [r for key in sorted(pool) for r in pool[key][: per_label // 2]]
    labels = tuple(sorted({r.intent for r in rows}))
    data = TrainData(labels=labels, train=train, dev=dev, source=f"{domain}.jsonl", dev_source=f"{domain}.jsonl dev")
    started = time.perf_counter()
    path, _ = train_intent(cfg, tmp / f"{domain}-{per_label}", progress=False, data=data, negatives=negatives)
    out = {"domain": domain, "per_label": per_label, "n_train": len(train), "n_dev": len(dev)}
    out |= measure(path, test, chat, dev) | {"wall_seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(out), flush=True)
    return out


def project(chat: list[str], tmp: Path) -> dict[str, Any]:
    """The project's 24-label model with the default recipe: dev accuracy, chit-chat rejection."""
    from miaohui.validate.run import load_data

    path, _ = train_intent(TrainConfig(), tmp / "project", progress=False)
    out: dict[str, Any] = {"dev": measure(path, load_data("dev"), chat)}
    print(json.dumps(out), flush=True)
    return out


def project_threshold(checkpoint: Path, chat: list[str]) -> dict[str, Any]:
    """An already trained 24-label checkpoint: fit the temperature and threshold on the project's dev split as
    ``train-intent`` does at its end, for each out-of-scope score, and measure the chit-chat texts with the model's own
    ``out_of_scope`` class alone and with the threshold (the texts it keeps and their answers)."""
    from miaohui.models.decision import fit_decision
    from miaohui.validate.run import load_data

    loaded = load_checkpoint(checkpoint)
    tok = TextTokenizer(loaded.tokenizer, loaded.meta.max_length)
    labels = loaded.meta.labels
    dev = load_data("dev")
    logits = full_logits(_module(loaded), tok, [x.text for x in dev], loaded.meta.max_length).numpy()
    gold = np.array([labels.index(x.intent) for x in dev])
    chat_logits = full_logits(_module(loaded), tok, chat, loaded.meta.max_length).numpy()
    own_class = [labels[i] == "out_of_scope" for i in chat_logits.argmax(-1)]
    out: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "stored_decision": loaded.meta.decision.model_dump() if loaded.meta.decision else None,
        "dev_accuracy": round(float((logits.argmax(-1) == gold).mean()), 4),
        "chitchat_out_of_scope_class_only": round(float(np.mean(own_class)), 4),
        "n_dev": len(dev),
        "n_chitchat": len(chat),
        "by_score": {},
    }
    cfg = TrainConfig()
    for kind in ("max_softmax", "energy"):
        decision = fit_decision(
            logits,
            gold,
            cfg.target_recall,
            oos_class=labels.index("out_of_scope"),
            score=kind,
        )
        answered = [d.intent for d in decide(logits, labels, decision)]
        chat_answers = decide(chat_logits, labels, decision)
        out["by_score"][kind] = {
            "default": kind == cfg.resolved_oos_score(negatives=False),
            "dev_accuracy_with_oos": round(
                float(np.mean([a == x.intent for a, x in zip(answered, dev, strict=True)])), 4
            ),
            "chitchat_rejected": round(float(np.mean([d.out_of_scope for d in chat_answers])), 4),
            "chitchat_kept": {t: d.intent for t, d in zip(chat, chat_answers, strict=True) if not d.out_of_scope},
            "decision": decision.model_dump(),
        }
    print(json.dumps(out), flush=True)
    return out


def plot(results: list[dict[str, Any]], file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for domain in DOMAINS:
        rows = sorted(
            (r for r in results if r["domain"] == domain and r.get("recipe") == "default"), key=lambda r: r["per_label"]
        )
        if not rows:
            continue
        xs = [r["per_label"] for r in rows]
        ax.plot(xs, [100 * r["test_accuracy"] for r in rows], "o-", label=f"{domain}: test accuracy")
        ax.plot(xs, [100 * r["test_accuracy_with_oos"] for r in rows], "^:", label=f"{domain}: with out-of-scope")
        ax.plot(xs, [100 * r["chitchat_rejected"] for r in rows], "s--", label=f"{domain}: chit-chat rejected")
    ax.axhline(90, color="grey", lw=0.8, ls=":")
    ax.axhline(85, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks([8, 16, 32, 64], ["8", "16", "32", "64"])
    ax.set_xlabel("training examples per label (6 labels, half zh, half en)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 101)
    ax.set_title("train-intent on your own labels (e5-small, CPU)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(file, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--domains", nargs="+", default=list(DOMAINS))
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--project", action="store_true")
    ap.add_argument(
        "--negatives",
        choices=sorted(NEGATIVES),
        default="tune",
        help="The --oos-data of every run: none, the 60 chit-chat tune texts, or those and 127 more.",
    )
    ap.add_argument(
        "--compare-negatives",
        action="store_true",
        help="At 32 a label, also train with each other --negatives set (recipe '--negatives NAME').",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "intent_small_data_cpu")
    ap.add_argument(
        "--append",
        action="store_true",
        help="Keep the results already in --out's JSON and add this command's (each result names its command).",
    )
    ap.add_argument(
        "--project-checkpoint", type=Path, help="Only fit and measure the threshold of this 24-label checkpoint."
    )
    args = ap.parse_args()
    negatives = [t for name in NEGATIVES[args.negatives] for t in load_texts(DATA / name)]
    chat = load_texts(DATA / "chitchat_test.jsonl")
    results: list[dict[str, Any]] = []
    doc: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit() or "unknown",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": {"cpu": platform.processor() or platform.machine(), "threads": TrainConfig().threads},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "note": "shared 2-core machine: train seconds are noisy; accuracies are deterministic per seed",
        "negatives": args.negatives,
        "results": results,
        "project": None,
    }
    doc["commands"] = [{"command": doc["command"], "commit": doc["commit"], "date": doc["date"]}]
    earlier = args.out.with_suffix(".json")
    if args.append and earlier.is_file():
        old = json.loads(earlier.read_text(encoding="utf-8"))
        before = old.get("commands") or [{k: old[k] for k in ("command", "commit", "date")}]
        for r in old["results"]:
            results.append({"command": before[0]["command"], "commit": before[0]["commit"]} | r)
        doc["commands"] = before + doc["commands"]
    if args.project_checkpoint is not None:
        found = project_threshold(args.project_checkpoint, chat)
        file = args.out.with_name(args.out.name + "_project.json")
        meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": doc["commit"]}
        meta["command"] = doc["command"]
        file.write_text(json.dumps(meta | found, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return

    def save() -> None:  # after every run: a long sweep that is stopped keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", "utf-8")
        plot(results, args.out.with_suffix(".png"))

    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            for domain in args.domains:
                tags = {"recipe": "default", "command": doc["command"], "commit": doc["commit"]}
                results.append(run(domain, n, TrainConfig(), negatives, chat, Path(tmp)) | tags)
                save()
                if n == 32 and args.compare_negatives:
                    for other in sorted(set(NEGATIVES) - {args.negatives}):
                        texts = [t for name in NEGATIVES[other] for t in load_texts(DATA / name)]
                        row = run(domain, n, TrainConfig(), texts, chat, Path(tmp))
                        results.append(row | {"recipe": f"--negatives {other}"})
                        save()
        if args.baseline:
            for domain in args.domains:
                old = TrainConfig(min_steps=0, evaluations=1, balanced=False)
                results.append(run(domain, 32, old, negatives, chat, Path(tmp)) | {"recipe": "8 epochs, last step"})
                results.append(run(domain, 32, TrainConfig(), [], chat, Path(tmp)) | {"recipe": "no --oos-data"})
                save()
        if args.project:
            doc["project"] = project(chat, Path(tmp))
            save()
    print(f"wrote {args.out.with_suffix('.json')} and .png")


if __name__ == "__main__":
    main()
