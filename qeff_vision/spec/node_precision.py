"""The named values of ``compile.node_precision`` (otherwise the path of a node precision file).

Their own module so :mod:`qeff_vision.spec.compile_options` and
:mod:`qeff_vision.spec.hardware_rules`, which it calls, both read them without importing each other.
"""

#: Derive the fp32 node list from the graph and calibration (the automatic precision plan).
NODE_PRECISION_AUTO = "auto"
#: No plan: every node at the compile's dtype.
NODE_PRECISION_NONE = "none"
