"""One stream's decode step on an int4 CPU decoder with the key/value cache copied each step (today) against written
in place (ONNX Runtime's ``GroupQueryAttention`` with its past and present bound to one buffer), interleaved in one
process (issue 44).

    .venv/bin/python -m lab.probes.one_row_kv_share REPO/smol/1 [--rounds 6] [--steps 120] [--prompt 100]

Modes, run in turn on one session (the order flips each round, so the machine's drift moves both alike):

* ``copy``: ``session.run`` with numpy feeds, each step's ``present`` outputs the next step's ``past`` inputs (the
  kernel copies the whole past into a fresh present: what the engine did before the in-place path).
* ``share``: IOBinding; each layer's past key/value bound to a preallocated ``[1, kv_heads, capacity, head_dim]``
  buffer and its present output to the same ``OrtValue`` (the kernel's ``past_present_share_buffer``: it writes the new
  token's key and value at the row's length and copies nothing else).
* ``engine-copy`` / ``engine``: :meth:`OrtCausalLMEngine.decode` with its in-place path turned off / on (where the
  engine has one): what the server's runner calls, KVCache and all.

A ``--prompt``-token prompt, then ``--steps`` greedy one-token steps (the first 20 not timed), two threads, as the
server runs them. Prints each round's median per mode, then the median and p90 over every timed step, and the share
path's largest |logit difference| from the copy path (same tokens fed).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

WARMUP = 20


def session(path: Path) -> object:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


class Raw:
    """The session alone: the prompt's prefill, then the copy or the share step."""

    def __init__(self, folder: Path) -> None:
        dims = json.loads((folder / "decoder.json").read_text())["dims"]
        self.layers, self.kv, self.hd = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
        self.vocab = dims["vocab"]
        self.s = session(folder / "model.onnx")
        self.names = [i.name for i in self.s.get_inputs()]  # type: ignore[attr-defined]
        self.out_names = [o.name for o in self.s.get_outputs()]  # type: ignore[attr-defined]

    def feeds(self, ids: np.ndarray, past: list[np.ndarray], pos: int) -> dict[str, np.ndarray]:
        n = ids.shape[1]
        f = {"input_ids": ids, "attention_mask": np.ones((1, pos + n), np.int64),
             "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None]}  # fmt: skip
        f.update(zip(self.names[3:], past, strict=True))
        return f

    def prefill(self, ids: np.ndarray) -> list[np.ndarray]:
        empty = [np.zeros((1, self.kv, 0, self.hd), np.float32)] * (2 * self.layers)
        return self.s.run(None, self.feeds(ids, empty, 0))  # type: ignore[attr-defined, no-any-return]

    def copy_steps(self, prompt: np.ndarray, steps: int) -> tuple[list[float], list[np.ndarray]]:
        out = self.prefill(prompt)
        times, logits, pos = [], [], prompt.shape[1]
        for _ in range(steps):
            token = np.array([[int(out[0].argmax())]])
            started = time.perf_counter()
            out = self.s.run(None, self.feeds(token, out[1:], pos))  # type: ignore[attr-defined]
            times.append(time.perf_counter() - started)
            logits.append(out[0])
            pos += 1
        return times, logits

    def share_steps(self, prompt: np.ndarray, steps: int) -> tuple[list[float], list[np.ndarray]]:
        import onnxruntime as ort

        out = self.prefill(prompt)
        n = prompt.shape[1]
        cap = n + steps + 1
        bufs = [np.zeros((1, self.kv, cap, self.hd), np.float32) for _ in range(2 * self.layers)]
        for b, p in zip(bufs, out[1:], strict=True):
            b[:, :, :n] = p
        values = [ort.OrtValue.ortvalue_from_numpy(b) for b in bufs]
        io = self.s.io_binding()  # type: ignore[attr-defined]
        for name, v in zip(self.names[3:], values, strict=True):
            io.bind_ortvalue_input(name, v)
        for name, v in zip(self.out_names[1:], values, strict=True):
            io.bind_ortvalue_output(name, v)
        logits_buf = np.zeros((1, self.vocab), np.float32)
        io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits_buf))
        ones = np.ones((1, cap + 1), np.int64)
        times, logits, last, pos = [], [], out[0], n
        for _ in range(steps):
            token = np.array([[int(last.argmax())]])
            started = time.perf_counter()
            io.bind_cpu_input("input_ids", token)
            io.bind_cpu_input("attention_mask", ones[:, : pos + 1])
            io.bind_cpu_input("position_ids", np.array([[pos]], np.int64))
            self.s.run_with_iobinding(io)  # type: ignore[attr-defined]
            last = logits_buf.copy()
            times.append(time.perf_counter() - started)
            logits.append(last)
            pos += 1
        return times, logits


def engine_steps(engine: object, prompt: np.ndarray, steps: int) -> tuple[list[float], list[np.ndarray]]:
    """:meth:`decode` steps of an :class:`OrtCausalLMEngine` after its prefill of ``prompt``."""
    logits, kv = engine.prefill([prompt[0].tolist()])  # type: ignore[attr-defined]
    times, out = [], []
    for _ in range(steps):
        token = int(logits[0].argmax())
        started = time.perf_counter()
        logits, kv = engine.decode([token], kv)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - started)
        out.append(logits)
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="an int4 decoder version (model.onnx + decoder.json)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--modes", default="copy,share", help="comma-separated: copy, share, engine-copy, engine")
    args = ap.parse_args()
    modes = args.modes.split(",")
    raw = Raw(args.folder)
    prompt = np.random.default_rng(0).integers(0, raw.vocab, (1, args.prompt)).astype(np.int64)
    runs: dict[str, Callable[[], tuple[list[float], list[np.ndarray]]]] = {
        "copy": lambda: raw.copy_steps(prompt, args.steps),
        "share": lambda: raw.share_steps(prompt, args.steps),
    }
    if {"engine", "engine-copy"} & set(modes):
        from miaohui.generation.executors.ort_engine import OrtCausalLMEngine

        on, off = OrtCausalLMEngine(args.folder, threads=2), OrtCausalLMEngine(args.folder, threads=2)
        off._in_place = None  # type: ignore[attr-defined]  # the copy path: every step through session.run
        runs["engine"] = lambda: engine_steps(on, prompt, args.steps)
        runs["engine-copy"] = lambda: engine_steps(off, prompt, args.steps)
    times: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, list[np.ndarray]] = {}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        row = {}
        for mode in order:
            t, logits = runs[mode]()
            times[mode] += t[WARMUP:]
            first.setdefault(mode, logits)
            row[mode] = float(np.median(t[WARMUP:]) * 1000)
        print(f"round {r}: " + "  ".join(f"{m} {row[m]:.2f} ms" for m in modes), flush=True)
    base = times[modes[0]]
    for mode in modes:
        ms = np.asarray(times[mode]) * 1000
        gain = 1 - np.median(times[mode]) / np.median(base)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(first[mode], first[modes[0]], strict=True))
        print(f"{mode}: median {np.median(ms):.2f} ms, p90 {np.percentile(ms, 90):.2f} ms over {len(ms)} steps; "
              f"{gain:+.1%} against {modes[0]}; max |logit difference| {diff:.2g}")  # fmt: skip


if __name__ == "__main__":
    main()
