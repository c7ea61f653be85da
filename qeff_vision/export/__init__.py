"""Generic torch -> ONNX building blocks: KV-cache ONNX functions, the language decoder wrapper, weights.

No family names live here; families plug in through :class:`~qeff_vision.export.adapter.ExportAdapter`
subclasses, and the driver that exports a checkpoint is :mod:`qeff_vision.exporter` (above the
families in the layering, docs/design.md "Layers").
"""
