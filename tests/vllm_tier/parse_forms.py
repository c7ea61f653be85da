"""Parse the printed plugin forms with vLLM's own argument machinery (runs in the vLLM venv).

Usage: ``python parse_forms.py FORMS.json``: a list of ``{"spec", "serve": [argv, ...],
"offline": [engine kwargs, ...]}``. Each ``vllm serve`` argv goes through vLLM 0.23's
``make_arg_parser`` after the qaic platform's ``pre_register_and_update`` (which adds ``mxfp6`` /
``mxint8`` to the choices, as ``vllm serve`` does with the plugin installed) and then
``EngineArgs.from_cli_args``; each offline ``LLM(**kwargs)`` through ``EngineArgs(**kwargs)``.
Prints one line per failure and exits 1 if any.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    failures = 0
    for entry in json.loads(Path(path).read_text()):
        for argv in entry["serve"]:
            parser = make_arg_parser(FlexibleArgumentParser())
            current_platform.pre_register_and_update(parser)
            assert argv[:2] == ["vllm", "serve"], argv
            try:
                args = parser.parse_args(["--model", argv[2], *argv[3:]])
                EngineArgs.from_cli_args(args)
            except (SystemExit, Exception) as exc:  # argparse exits on a bad argument
                failures += 1
                print(f"{entry['spec']}: vllm serve rejected {argv}: {exc!r}")
        for kwargs in entry["offline"]:
            try:
                EngineArgs(**kwargs)
            except Exception as exc:
                failures += 1
                print(f"{entry['spec']}: EngineArgs rejected {kwargs}: {exc!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
