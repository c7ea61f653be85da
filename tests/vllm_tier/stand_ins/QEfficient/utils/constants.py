"""QEfficient's default Qwen2.5-VL compile resolution (unused: the tier passes height/width)."""

# ref: QEfficient utils/constants.py QWEN2_5_VL_HEIGHT / QWEN2_5_VL_WIDTH
QWEN2_5_VL_HEIGHT = 354
QWEN2_5_VL_WIDTH = 536
