"""The compiler command line of one program: a pure function of files, options and SDK facts.

Every flag comes from a typed option (:class:`~qeff_vision.spec.compile_options.ProgramOptions`); there
is no pass-through of free-form flags. Flag spellings follow QEfficient's compile path
(ref: quic/efficient-transformers QEfficient/base/modeling_qeff.py ``_compile``), which is what
the SDK's compiler accepts for these LLM/VLM programs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qeff_vision.compile.sdk import QAIC_EXEC
from qeff_vision.spec.compile_options import LANGUAGE, PROGRAM_DIRS, ProgramOptions

PARTITION_FILE_NAME = "mdp_partition.json"
SPECIALIZATIONS_FILE_NAME = "specializations.json"
CUSTOM_IO_FILE_NAME = "custom_io.yaml"


@dataclass(frozen=True)
class ProgramFiles:
    """Files one compile reads and the directory it writes.

    Attributes:
        onnx: The exported graph (external data beside it).
        specializations: ``specializations.json`` (flat or named layout).
        custom_io: ``custom_io.yaml``, or ``None`` when every IO keeps the graph's types.
        partition_config: MDP partition file, present exactly when the program spans devices.
        binary_dir: Where the compiler writes ``programqpc.bin`` (``-aic-binary-dir``).
        node_precision: ``node_precision.yaml``, the node outputs kept in fp32 under
            ``-convert-to-fp16`` (``-node-precision-info``), or ``None`` for no plan.
    """

    onnx: Path | str
    specializations: Path | str
    custom_io: Path | str | None
    partition_config: Path | str | None
    binary_dir: Path | str
    node_precision: Path | str | None = None

    @classmethod
    def placeholders(
        cls, options: ProgramOptions, has_custom_io: bool = True, has_plan: bool = False
    ) -> ProgramFiles:
        """Stand-in names for every path: the argv of a cache key must not depend on where OUT is."""
        return cls(
            onnx="<onnx>",
            specializations="<specializations>",
            custom_io="<custom_io>" if has_custom_io else None,
            partition_config="<partition_config>" if options.num_devices > 1 else None,
            binary_dir="<binary_dir>",
            node_precision="<node_precision>" if has_plan else None,
        )


def is_language(program: str) -> bool:
    """True for a language decoder: ``lang``, ``language``, or ``lang_prefill`` / ``lang_decode``."""
    return program in (LANGUAGE, PROGRAM_DIRS[LANGUAGE]) or program.startswith(PROGRAM_DIRS[LANGUAGE] + "_")


def mdp_partition_config(num_devices: int, num_cores: int) -> dict[str, Any]:
    """Tensor-slicing MDP partition: one partition over devices 0..n-1, all peer-to-peer connected.

    Same shape as QEfficient's generated file (ref: quic/efficient-transformers
    QEfficient/utils/_utils.py ``generate_mdp_partition_config``); the runtime maps these logical
    device ids onto the device group it is given.
    """
    if num_devices < 2:
        raise ValueError("a partition file is only needed for two or more devices")
    devices = list(range(num_devices))
    return {
        "connections": [{"devices": devices, "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [{"deviceId": device, "numCores": num_cores} for device in devices],
            }
        ],
    }


def build_argv(
    compiler: Path | str,
    program: str,
    files: ProgramFiles,
    options: ProgramOptions,
    *,
    compiler_name: str = QAIC_EXEC,
    hw_version: str | None = None,
    retained_state: bool | None = None,
) -> list[str]:
    """The full compiler argv for one program. Pure: no file is read or written.

    Args:
        compiler: Compiler executable (argv[0]).
        program: ``vision`` or ``lang``/``language``; the language program keeps its KV cache and
            ``vision_embeds`` on the device (``-retained-state``).
        files: Inputs and output directory.
        options: Validated options of this program.
        compiler_name: ``qaic-exec`` (needs ``-compile-only`` to stop after compiling) or
            ``qaic-compile`` (compiles only).
        hw_version: ``-aic-hw-version`` value as the SDK spells it; ``options.aic_hw_version`` by
            default.
        retained_state: Pass ``-retained-state``; by default for a language program. A pooling
            language program (spec ``task: embed | score``) keeps no state: False.
    """
    if (files.partition_config is not None) != (options.num_devices > 1):
        raise ValueError("a partition file must be given exactly when num_devices > 1")
    argv = [
        str(compiler),
        f"-m={files.onnx}",
        "-aic-hw",
        f"-aic-hw-version={hw_version or options.aic_hw_version}",
        f"-network-specialization-config={files.specializations}",
    ]
    if files.custom_io is not None:
        argv.append(f"-custom-IO-list-file={files.custom_io}")
    if is_language(program) if retained_state is None else retained_state:
        argv.append("-retained-state")
    if options.convert_to_fp16:
        argv.append("-convert-to-fp16")
        if files.node_precision is not None:
            argv.append(f"-node-precision-info={files.node_precision}")
    argv.append(f"-aic-num-cores={options.num_cores}")
    if options.mxfp6_matmul:
        argv.append("-mxfp6-matmul")
    if options.mos is not None:
        argv.append(f"-mos={options.mos}")
    if options.ols is not None:
        argv.append(f"-ols={options.ols}")
    if options.depth_first:
        argv.append("-aic-enable-depth-first")
    if files.partition_config is not None:
        argv.append(f"-mdp-load-partition-config={files.partition_config}")
    # Deployment flags (ref: the Cloud AI disaggregated-serving launcher: prefill
    # -allow-mxint8-mdp-io, decode also -split-retained-state-io); None counts as off here, the
    # deployment's defaults are resolved before (qeff_vision.compile.deployment).
    if options.allow_mxint8_mdp_io:
        argv.append("-allow-mxint8-mdp-io")
    if options.split_retained_state_io:
        argv.append("-split-retained-state-io")
    if options.split_model_io:
        argv.append("-split-model-io")
    if options.subfunctions:  # decoder layers exported as ONNX functions (QEfficient's flag)
        argv.append("-sub-functions")
    argv.append(f"-aic-binary-dir={files.binary_dir}")
    if compiler_name == QAIC_EXEC:
        argv.append("-compile-only")
    return argv


def argv_without_paths(
    program: str,
    options: ProgramOptions,
    *,
    has_custom_io: bool = True,
    compiler_name: str = QAIC_EXEC,
    hw_version: str | None = None,
    has_plan: bool = False,
    retained_state: bool | None = None,
) -> list[str]:
    """The argv with every path replaced by a placeholder and argv[0] by the compiler's name.

    Part of a program's cache key: moving OUT or the SDK does not invalidate a compiled program.
    """
    files = ProgramFiles.placeholders(options, has_custom_io, has_plan)
    return build_argv(
        compiler_name,
        program,
        files,
        options,
        compiler_name=compiler_name,
        hw_version=hw_version,
        retained_state=retained_state,
    )


def format_command(argv: list[str]) -> str:
    """One shell-quoted line, ready to paste."""
    return shlex.join(argv)
