"""How much does weight-only int8 (``SlotEngineOptions.int8_batch1``) change a real model's greedy
answers? SmolLM2-135M-Instruct (real weights), the static-KV engine run eagerly on this CPU in fp32 (the same int8
arithmetic the GPU graphs compile: per-row scales, ``F.linear(x, q.to(dtype)) * scale``), chat prompts, greedy.

Configuration: ``int8_batch1`` with the prompts decoded one at a time (every decode step reads int8). Against the
unquantized engine on the same prompts:
exact-answer rate, tokens before the first difference, and, teacher-forced on the unquantized answer, the share of
positions where the int8 model's top token is the same (no divergence cascade).

    python benchmarks/bench_int8_agreement_cpu.py   # → benchmarks/results/int8_agreement_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from miaohui.generation.engine.engine_loop import LLMEngine
from miaohui.generation.engine.params import SamplingParams
from miaohui.generation.executors.slot_engine import TorchSlotEngine
from miaohui.generation.executors.slot_options import SlotEngineOptions
from miaohui.generation.models.static_kv import StaticKVDecoder
from miaohui.zoo.smollm import encode_chat, load_smollm2

QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a bank deposit is in two sentences.",
    "List three fruits and describe each one briefly.",
    "How do I book a meeting room for tomorrow morning?",
    "What should I consider before investing in a mutual fund?",
    "Give me two tips for negotiating a salary.",
    "Summarise why people use public transport.",
    "What is the capital of France, and why is it famous?",
]


def engine(model: Any, eos: int, slots: int, batch1: bool) -> TorchSlotEngine:
    opts = SlotEngineOptions(num_slots=slots, max_len=512, dtype="fp32", int8_batch1=batch1)
    dec = StaticKVDecoder.from_hf(model, num_slots=slots, max_len=512, dtype=torch.float32)
    return TorchSlotEngine(dec, [eos], 0, opts)


def teacher_forced_top1(eng: TorchSlotEngine, prompt: list[int], answer: list[int]) -> float:
    """Share of the answer's positions where the engine's top token (decoding ``answer`` one step at a time, batch
    1) equals the answer's next token."""
    dec = eng.model
    same = 0
    with torch.inference_mode():
        logits = dec.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([0]))
        for i, tok in enumerate(answer):
            same += int(int(logits[0].argmax()) == tok)
            if i + 1 == len(answer):
                break
            pos = len(prompt) + i
            logits = dec.decode(torch.tensor([tok]), torch.tensor([pos]), 512)
    return same / len(answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/int8_agreement_cpu.json"))
    args = ap.parse_args()
    model, tok, _ = load_smollm2()
    prompts = [encode_chat([{"role": "user", "content": q}], tokenizer=tok) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    eos = int(tok.eos_token_id)
    t0 = time.perf_counter()
    base = [out[0] for out in LLMEngine(engine(model, eos, 8, False), None).generate(prompts, params)]
    runs: dict[str, list[list[int]]] = {
        # one prompt at a time: every decode step has one row, so int8_batch1 covers all of them
        "int8_batch1 (one stream at a time)": [
            LLMEngine(engine(model, eos, 1, True), None).generate([p], params)[0][0] for p in prompts
        ],
    }
    forced = engine(model, eos, 1, True)
    top1 = [teacher_forced_top1(forced, p, b) for p, b in zip(prompts, base, strict=True)]
    report: dict[str, Any] = {
        "command": "python benchmarks/bench_int8_agreement_cpu.py",
        "model": "SmolLM2-135M-Instruct (real weights), fp32 static-KV engine, eager, CPU",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "teacher_forced_top1_agreement": statistics.mean(top1),
        "configs": {},
    }
    for name, answers in runs.items():
        firsts = []
        for a, b in zip(answers, base, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            firsts.append(n if a != b else len(b))
        report["configs"][name] = {
            "exact_answers": sum(a == b for a, b in zip(answers, base, strict=True)) / len(base),
            "tokens_before_first_difference_median": statistics.median(firsts),
            "tokens_before_first_difference_each": firsts,
            "example": {"fp32": tok.decode(base[1]), "int8": tok.decode(answers[1])},
        }
        print(name, json.dumps({k: v for k, v in report["configs"][name].items() if k != "example"}), flush=True)
    print(f"teacher-forced top-1 agreement: {report['teacher_forced_top1_agreement']:.3f}", flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
