"""miaohui (秒回): compile dialogue models into checked, optimized engines and serve them in milliseconds.

The subpackages are layered; a module imports only from its own layer or the ones below it (imports inside
functions count too), so there is no import cycle between them. Lowest first: the shared basics ``errors``,
``paths`` (where things live, what a model name may be), ``config``, ``gil``, ``gcpolicy``; then ``nlp`` (text
normalisation, slots, keyword categories) and ``zoo`` (shipped models and data, as files and loaders);
``models`` (PyTorch models, checkpoints, training); ``sources`` (what a user brings: a checkpoint, a Hugging
Face directory or an ONNX file, read into one model form); ``compile`` (export, graph rewrites, quantization);
``engines`` (the ``Engine`` backends, the artifact store); ``generation`` (causal-LM engines and the
continuous-batching loop); ``validate`` (accuracy gate, golden outputs, drift between two engines);
``serving`` (batcher, model repository, engine process, shadow mode); ``dialogue`` (pipelines per business
line, their gate and ``compare``); ``server`` (HTTP, gRPC, OpenAI API, metrics, workers); ``bench``; and at the
top ``prepare`` and ``cli``, which wire the layers together. A lower layer that must reach up takes a callback
or a protocol from the caller instead (e.g. ``serving.shadow.ShadowMetrics``, the batcher's and the generation
loop's observers). ``tests/unit/test_layering.py`` checks this order.
"""

__version__ = "0.1.0"
