from qeff_vision.cli import entry

entry()
