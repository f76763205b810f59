"""miaohui.bench — the load generator behind ``miaohui bench``.

targets.py  what is loaded: HTTP /v1/intent, KServe v2 HTTP and gRPC, or a bare engine
chat.py     the chat target: streamed OpenAI /v1/chat/completions or /v1/completions, one record per stream
load.py     closed-loop (N workers) and open-loop (Poisson) runs, worker processes, one clock
scrape.py   the server's /metrics before/after a run → where the time goes (queue, compute, batch)
report.py   percentiles, throughput, error accounting (sent == answered + errors), JSON document
chat_report.py  the chat target's TTFT, inter-token latency, tokens/s per request and in all; its table and PNG
plot.py     PNG: latency percentiles vs throughput
sweep.py    texts, load levels, one measurement per level
cli.py      the typer command (registered in miaohui.cli)
kernel_timeline.py  a GPU profile's kernels as a timeline: each kernel's time alone under PDL overlap (GPU benchmarks)
"""
