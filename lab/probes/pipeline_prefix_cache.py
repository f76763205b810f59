"""Prefix-cache hit rate of a multi-turn dialogue pipeline conversation (issue 47).

The negotiation coach (its llm route, 32-token greedy replies so that it runs in a minute on a loaded CPU) answers
TURNS user turns of one session through the server's own generator (``LLMTextGenerator``) over SmolLM2-135M-Instruct
(fp32 ONNX Runtime, the cached test repository); the intent model is replaced by a constant out_of_scope classifier
(the route the coach answers with the model). Prints per turn the prompt tokens, whether the prompt starts with the
previous turn's prompt + answer tokens, and the cumulative miaohui_prefix_cache_hit_tokens_total / queried.

    PYTHONPATH=src:. python lab/probes/pipeline_prefix_cache.py --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from miaohui.dialogue import Pipeline
from miaohui.server.metrics import Metrics
from miaohui.server.observer_metrics import chat_observers
from miaohui.server.openai_api import LLMTextGenerator
from miaohui.serving.repository import ModelManager

TURNS = [
    "对方要求降价15%，我该如何应对？",
    "他们说竞争对手便宜10%。",
    "我们的底线是降价5%。",
    "对方还要求延长账期到90天。",
    "如果我同意账期，能要求什么回报？",
    "对方说今天必须答复。",
    "我想先拒绝再给折中方案。",
    "折中方案怎么说比较好？",
    "如果对方坚持15%呢？",
    "最后怎么收尾？",
    "谢谢，还有别的建议吗？",
    "好的，就这样。",
]


class OutOfScope:
    async def classify(self, texts: list[str]) -> list[tuple[str, float]]:
        return [("out_of_scope", 0.9) for _ in texts]


def counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


async def main(turns: int) -> None:
    from tests.prebuild import LLM_MODEL, ensure_llm_repository

    work = Path(tempfile.mkdtemp(prefix="prefix-probe-"))
    try:
        shutil.copytree(ensure_llm_repository() / LLM_MODEL, work / "repo" / LLM_MODEL, copy_function=os.link)
        cfg = yaml.safe_load(Path("src/miaohui/dialogue/pipelines/negotiation_coach.yaml").read_text())
        cfg["llm"].update(max_tokens=32, temperature=0.0, history_turns=8)
        (work / "p.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
        metrics = Metrics()
        observers = chat_observers(metrics)
        manager = ModelManager(work / "repo", observer_factory=metrics.observer, chat_observer_factory=observers)
        await manager.load_all()
        gen = LLMTextGenerator(manager, LLM_MODEL)
        seen: list[list[int]] = []
        inner = gen.generate

        async def recording(messages, max_tokens, temperature=0.0):  # type: ignore[no-untyped-def]
            llm = manager.chat(LLM_MODEL)
            seen.append(llm.tokenizer.encode_chat([dict(m) for m in messages]))
            text = await inner(messages, max_tokens, temperature)
            seen[-1] = seen[-1] + llm.tokenizer.encode(text)  # prompt + answer tokens (re-encoded)
            return text

        gen.generate = recording  # type: ignore[method-assign]
        pipe = Pipeline.from_name(work / "p.yaml", OutOfScope(), gen)
        rows = []
        for k, text in enumerate(TURNS[:turns]):
            await pipe.run_turn(text, "probe")
            prev_ok = k == 0 or seen[k][: len(seen[k - 1])] == seen[k - 1]
            page = metrics.render()
            page = page.decode() if isinstance(page, bytes) else page
            hit = counter(page, "miaohui_prefix_cache_hit_tokens_total")
            queried = counter(page, "miaohui_prefix_cache_queried_tokens_total")
            rows.append(
                {
                    "turn": k + 1,
                    "tokens": len(seen[k]),
                    "starts_with_previous": prev_ok,
                    "hit": hit,
                    "queried": queried,
                    "hit_rate": round(hit / queried, 3) if queried else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        await manager.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=8)
    asyncio.run(main(parser.parse_args().turns))
