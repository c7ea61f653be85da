"""Per-deployment compile facts: each program's options with the deployment's defaults, golden argv.

The deployment flags default to what the serving launchers pass (ref: the Cloud AI
disaggregated-serving launcher's default compile arguments: prefix/prefill
``allow-mxint8-mdp-io``; decode ``split-retained-state-io`` and ``allow-mxint8-mdp-io``; every
QEfficient VLM example compiles with ``-split-model-io``). The dual and single deployments keep
them off unless the spec sets them, so existing programs keep their command lines and cache keys.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qeff_vision.compile.argv import argv_without_paths, format_command
from qeff_vision.spec.compile_options import NODE_PRECISION_NONE, CompileOptions, ProgramOptions
from qeff_vision.spec.deployment import Deployment

DEPLOYMENT_FLAGS = ("split_model_io", "allow_mxint8_mdp_io", "split_retained_state_io")


def program_options(options: CompileOptions, deployment: Deployment, program: str) -> ProgramOptions:
    """The options ``program`` (a directory: ``vision``, ``lang``, ``lang_prefill``...) compiles with.

    The spec's ``compile:`` section for the program's kind (``vision`` or ``language``), with every
    deployment flag it leaves unset given the deployment's default (off when none).
    """
    table = deployment.table  # the mode's programs and their flag defaults
    own = options.program(table.programs[program])
    defaults = table.flag_defaults.get(program, {})
    unset = {flag: defaults.get(flag, False) for flag in DEPLOYMENT_FLAGS if getattr(own, flag) is None}
    return replace(own, **unset)


def golden_commands(spec: Any) -> str:
    """Every program's compiler command line for ``spec`` (as ``compile --dry-run``, paths as placeholders).

    Written to ``specs/golden/<name>/compile_commands.txt`` for specs that set a deployment, so a
    change of a program's flags shows up as a golden diff.
    """
    lines = [f"# deployment: {spec.deployment.mode}; paths are placeholders (compile --dry-run shows them)"]
    for program in spec.deployment.programs:
        options = program_options(spec.compile, spec.deployment, program)
        has_plan = options.convert_to_fp16 and options.node_precision != NODE_PRECISION_NONE
        argv = argv_without_paths(program, options, has_plan=has_plan)
        lines.append(f"{program}: {format_command(argv)}")
    return "\n".join(lines) + "\n"
