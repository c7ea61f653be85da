"""Generic torch -> ONNX export: KV-cache ONNX functions, the language decoder wrapper, the driver.

No family names live here; families plug in through :class:`~qeff_vision.export.adapter.ExportAdapter`.
"""
