"""Where a build's model comes from: a miaohui checkpoint, a Hugging Face directory, or an ONNX file.

:func:`~miaohui.sources.detect.open_source` tells them apart and reads what each is (task, labels, digest)
without loading weights; :meth:`Source.load` then gives the one :class:`~miaohui.models.checkpoint.LoadedModel`
every backend builds from.
"""
