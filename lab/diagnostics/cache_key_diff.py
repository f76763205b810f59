"""Which parts of Inductor's FX-graph / AOTAutograd cache keys differ between two processes' logs.

    TORCH_LOGS="+torch._inductor.codecache,+torch._functorch._aot_autograd.autograd_cache" <build> > build.log
    ... <serve> > serve.log
    python -m lab.diagnostics.cache_key_diff build.log serve.log

torch logs one "hash details" block per compiled graph at debug level, one glog line per key part:
``V1206 00:07:14.006000 1825 torch/_functorch/_aot_autograd/autograd_cache.py:632] [0/0] [<hash>] grad_enabled: False``
(parts that span lines, the graph's code, continue on lines with the same prefix). Blocks are matched by kind (FX
graph / AOTAutograd) and Dynamo's compile id (``[frame/compile]``); for each pair it prints the key parts whose text
differs and those whose text is equal but whose hash is not. torch hashes a real tensor or parameter with its
values and shows only its metadata, so a part in the second list is an input whose values (or whose pickled form)
differ between the two processes.
"""

from __future__ import annotations

import re
import sys

LINE = re.compile(r"^[VIWDE]\d{4} [\d:.]+ \d+ (\S+)\] (?:\[(\d+/\d+)\] )?(.*)$")
PART = re.compile(r"^\[([a-z0-9]{20,})\] (.*)$")
HEAD = re.compile(r"^(FX graph|Autograd graph) cache hash details for key (\S+?):?$")

Block = dict[str, tuple[str, str]]  # part name -> (hash, text)


def blocks(path: str) -> dict[tuple[str, str], Block]:
    """(kind, compile id) -> the block's key parts (the last block of that id when torch logged it twice)."""
    found: dict[tuple[str, str], Block] = {}
    current: Block | None = None
    where: str | None = None  # the logging call (file:line) of the current block's lines
    last: str | None = None
    with open(path, errors="replace") as f:
        for raw in f:
            m = LINE.match(raw.rstrip("\n"))
            if not m:  # a part's value with newlines of its own (a pickled config's bytes)
                if current is not None and last is not None:
                    h, text = current[last]
                    current[last] = (h, text + "\n" + raw.rstrip("\n"))
                continue
            cid, body = m.group(2) or "-", m.group(3)
            head = HEAD.match(body)
            if head:
                current, where = {}, m.group(1)
                found[(head.group(1), cid)] = current
                last = None
                continue
            if current is None or m.group(1) != where:
                current = None
                continue
            part = PART.match(body)
            if part:
                name, _, text = part.group(2).partition(": ")
                current[name] = (part.group(1), text)
                last = name
            elif last is not None:  # a continuation line of the last part (e.g. the graph's code)
                h, text = current[last]
                current[last] = (h, text + "\n" + body)
    return found


def main() -> None:
    a, b = blocks(sys.argv[1]), blocks(sys.argv[2])
    print(f"{sys.argv[1]}: {len(a)} blocks; {sys.argv[2]}: {len(b)} blocks")
    for key in sorted(set(a) & set(b)):
        text_differs, hash_differs = [], []
        for name in sorted(set(a[key]) | set(b[key])):
            (ha, ta), (hb, tb) = a[key].get(name, ("", "<absent>")), b[key].get(name, ("", "<absent>"))
            if ta != tb:
                text_differs.append(f"{name}: {ta[:160]!r} | {tb[:160]!r}")
            elif ha != hb:
                hash_differs.append(name)
        if text_differs or hash_differs:
            print(f"{key[0]} {key[1]}:")
            for line in text_differs[:20]:
                print("   text:", line)
            if hash_differs:
                print("   same text, other hash:", ", ".join(hash_differs[:20]))
    for key in sorted(set(a) ^ set(b)):
        print(f"{key[0]} {key[1]}: only in {sys.argv[1] if key in a else sys.argv[2]}")


if __name__ == "__main__":
    main()
