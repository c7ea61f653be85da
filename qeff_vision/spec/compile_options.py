"""Typed, validated compiler options for the two programs of a dual QPC.

The ``compile:`` section of a spec sets options once for both programs and overrides them per
program; the vision encoder and the language decoder may differ in cores, devices and precision::

    compile:
      num_cores: 16            # shared default for both programs
      vision:
        mxfp6_matmul: false    # the vision encoder is small; keep its matmuls in fp16
      language:
        num_devices: 4         # one language program spread over four devices (MDP)
        kv_cache_dtype: mxint8

Every option maps to one compiler flag (see :mod:`qeff_vision.compile.argv`); there is no untyped
pass-through of unknown flags. :func:`parse_compile_options` reports every problem at once, each
prefixed by its YAML path, so the spec loader can merge them into one :class:`SpecError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from qeff_vision.contract.attention_blocking import DEFAULT_BOUND
from qeff_vision.contract.sampler_io import SamplerOptions
from qeff_vision.errors import shown
from qeff_vision.spec.ccl_lists import compiler_ccl_lists
from qeff_vision.spec.hardware import AI100, AI100_NUMERIC, AI200, AUTO, BFLOAT16, HwDetection
from qeff_vision.spec.node_precision import NODE_PRECISION_AUTO, NODE_PRECISION_NONE  # noqa: F401 - re-exported

VISION = "vision"
LANGUAGE = "language"
# YAML section name -> directory name of the program under the output directory.
PROGRAM_DIRS: dict[str, str] = {VISION: "vision", LANGUAGE: "lang"}

# float16 and mxint8 on ai100; bfloat16 on ai200 (its default there).
KV_CACHE_DTYPES = ("float16", "mxint8", BFLOAT16)
# Recurrent (linear-attention) state on the device: fp32 as transformers keeps it, fp16 (ai100) or
# bf16 (ai200's default).
STATE_DTYPES = ("float32", "float16", BFLOAT16)
# "ai100" is the current spelling; "2.0" is what older SDKs (and older QEfficient) pass; "ai200"
# computes in bfloat16; "auto" asks qaic-util (qeff_vision.spec.hardware).
AIC_HW_VERSIONS = (AI100, AI100_NUMERIC, AI200, AUTO)
# One AI 100 SoC has up to 16 neural signal processors (cores).
MAX_CORES_PER_DEVICE = 16
# Default of compile.max_activation_bytes: 256 MiB at the device dtype, the bound the blocked
# attention forms are sized for (qeff_vision/contract/attention_blocking.py).
DEFAULT_MAX_ACTIVATION_BYTES = DEFAULT_BOUND
# Keys that only make sense for the language program (it owns the KV cache).
LANGUAGE_ONLY_KEYS = frozenset({"kv_cache_dtype", "state_dtype", "sampler", "subfunctions"})


@dataclass(frozen=True)
class ProgramOptions:
    """Compiler options of one program (vision encoder or language decoder).

    Attributes:
        num_cores: Cores per device (``-aic-num-cores``), 1..16.
        num_devices: Devices the program is partitioned over. Above 1 the argv builder writes an
            MDP partition file and passes ``-mdp-load-partition-config``.
        mxfp6_matmul: Compress matmul weights to MXFP6 (``-mxfp6-matmul``). On by default for the
            language program, off for the vision encoder.
        convert_to_fp16: Run fp32 graphs in fp16 (``-convert-to-fp16``).
        mos: Maximum output channel split (``-mos``); ``None`` leaves the compiler default.
        ols: Overlap split factor (``-ols``); ``None`` leaves the compiler default.
        depth_first: Depth-first scheduling (``-aic-enable-depth-first``).
        aic_hw_version: Target hardware (``-aic-hw-version``): ``ai100`` (or ``2.0``), ``ai200``
            (bfloat16 compute: no ``-convert-to-fp16``, bfloat16 weights, IO and state), or
            ``auto`` (``qaic-util -q`` decides, ``ai100`` when no device answers;
            :mod:`qeff_vision.spec.hardware`). Both programs target one kind of device.
        kv_cache_dtype: Element type of the KV cache held on the device: ``float16`` or ``mxint8``
            on ai100, ``bfloat16`` on ai200 (language program only; it decides the custom IO of
            every retained cache). The default follows the hardware.
        state_dtype: Element type of recurrent layers' state held on the device (``conv_state.*``,
            ``recurrent_state.*``): ``float32`` (as transformers keeps it), ``float16`` (ai100) or
            ``bfloat16`` (ai200, its default there) (language program only; unused by families
            without recurrent layers).
        timeout: Seconds the compiler may run before it is stopped; ``None`` waits forever.
        node_precision: Node outputs kept in fp32 under ``-convert-to-fp16``
            (``-node-precision-info``): ``auto`` computes the plan from calibration runs of the
            fp32 graph (:mod:`qeff_vision.numerics.plan`), ``none`` passes no plan, any other
            value is the path of a plan file in the compiler's format (relative to the spec).
        split_model_io: ``-split-model-io`` (every QEfficient VLM example passes it); ``None``
            takes the deployment's default (:mod:`qeff_vision.compile.deployment`).
        allow_mxint8_mdp_io: ``-allow-mxint8-mdp-io`` (the disaggregated launcher's choice for
            both language programs); ``None``: the deployment's default.
        split_retained_state_io: ``-split-retained-state-io`` (the launcher's choice for the
            decode program); ``None``: the deployment's default.
        sampler: QEfficient's on-device sampler in the language program (``{max_top_k_ids: 512,
            return_pdfs: false, guided_decoding: false}``, each key optional): it returns
            ``next_tokens`` instead of ``logits``; ``None`` (default) returns logits. Not a
            compiler flag: it changes the exported graph (:mod:`qeff_vision.export.sampler`).
        subfunctions: Export each decoder layer as an ONNX local function, one function per
            distinct layer body, called once per layer with that layer's weights, and pass
            ``-sub-functions`` (QEfficient's ``use_onnx_subfunctions``; language program only;
            :mod:`qeff_vision.export.subfunctions`). The compiler then works on one body per layer
            signature instead of one copy per layer.
    """

    num_cores: int = MAX_CORES_PER_DEVICE
    num_devices: int = 1
    mxfp6_matmul: bool = False
    convert_to_fp16: bool = True
    mos: int | None = None
    ols: int | None = None
    depth_first: bool = False
    aic_hw_version: str = AIC_HW_VERSIONS[0]
    kv_cache_dtype: str = KV_CACHE_DTYPES[0]
    state_dtype: str = STATE_DTYPES[0]
    timeout: float | None = None
    node_precision: str = NODE_PRECISION_AUTO
    split_model_io: bool | None = None
    allow_mxint8_mdp_io: bool | None = None
    split_retained_state_io: bool | None = None
    sampler: SamplerOptions | None = None
    subfunctions: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain dictionary (for manifests and cache keys)."""
        return asdict(self)


def _default_language() -> ProgramOptions:
    return ProgramOptions(mxfp6_matmul=True)


@dataclass(frozen=True)
class CompCtxLengths:
    """Compute-context lengths (CCL) of the language program, as QEfficient offers them.

    Each is a number of KV slots attention reads (the first ones): the language graph gains an
    input ``comp_ctx_lengths`` whose length selects it, and every prefill bucket (resp. decode)
    gets one specialization per prefill (resp. decode) CCL, from the lists as QEfficient rewrites
    them (:meth:`compiled`). The runtime feeds the smallest CCL that covers the furthest position
    written so far, so early steps read a fraction of the cache.

    Attributes:
        prefill: Strictly increasing CCLs for prefill chunks.
        decode: Strictly increasing CCLs for decode steps.
    """

    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    def compiled(self, ctx_len: int) -> CompCtxLengths:
        """The lists QEfficient hands the compiler for these (:mod:`qeff_vision.spec.ccl_lists`).

        Raised to 1024 at least, ``ctx_len`` appended, capped, and every prefill value a decode
        value holds moved down to a multiple of 32: each decode position has a CCL covering it,
        each prompt position below the last prefill CCL too.
        """
        return CompCtxLengths(*compiler_ccl_lists(self.prefill, self.decode, ctx_len))


# Longest calibration prompt the language program runs (Calibration.max_prompt_tokens).
DEFAULT_MAX_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class Calibration:
    """Inputs of the calibration runs that find an ``auto`` precision plan (``compile.calibration``).

    Attributes:
        images: Image paths (relative to the spec) replacing the synthetic images at the spec's
            resolutions.
        prompts: Prompts replacing the default one.
        max_prompt_tokens: Longest prompt (tokens, image placeholders included) the language
            program runs in calibration; a longer image prompt's image still goes through the
            vision program. When every image prompt is longer, the shortest one runs whole, so
            image rows always reach the language program. ``null``: every prompt runs whole.
            Default 1024: at 1080x1920 a prompt can be 2,700 tokens, 22 prefill chunks
            that repeat what the first ones record (issue 48).
    """

    images: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS


CALIBRATION_KEY = "calibration"
_CALIBRATION_KEYS = ("images", "prompts", "max_prompt_tokens")


def parse_calibration(value: Any, path: str) -> tuple[Calibration | None, list[str]]:
    """Read ``calibration: {images: [paths], prompts: [texts], max_prompt_tokens: N}`` (all optional)."""
    if not isinstance(value, Mapping):
        return None, [f"{path}: must be a mapping with images and/or prompts lists"]
    problems = [
        f"{path}.{key}: unknown key; allowed: {', '.join(_CALIBRATION_KEYS)}"
        for key in value
        if key not in _CALIBRATION_KEYS
    ]
    budget = value.get("max_prompt_tokens", DEFAULT_MAX_PROMPT_TOKENS)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        problems.append(f"{path}.max_prompt_tokens: must be a positive integer or null, got {budget!r}")
    lists = {}
    for key in ("images", "prompts"):
        items = value.get(key, [])
        if not isinstance(items, list) or not all(isinstance(i, str) and i.strip() for i in items):
            problems.append(f"{path}.{key}: must be a list of non-empty strings")
            continue
        lists[key] = tuple(items)
    if problems:
        return None, problems
    return Calibration(lists["images"], lists["prompts"], budget), []


@dataclass(frozen=True)
class CompileOptions:
    """Options of both programs. ``language`` defaults to MXFP6 matmuls, ``vision`` does not.

    ``comp_ctx_lengths`` (compute-context lengths) is not a compiler flag: it adds an input to the
    language graph and multiplies its specializations.
    """

    vision: ProgramOptions = field(default_factory=ProgramOptions)
    language: ProgramOptions = field(default_factory=_default_language)
    comp_ctx_lengths: CompCtxLengths | None = None
    calibration: Calibration | None = None
    # Bound on any one intermediate value of any specialization, bytes at the device dtype; None:
    # no bound (the figures are still reported). See qeff_vision/compile/activation_memory.py.
    max_activation_bytes: int | None = DEFAULT_MAX_ACTIVATION_BYTES
    # What ``aic_hw_version: auto`` resolved to (None when the spec names the hardware).
    detection: HwDetection | None = None

    @property
    def hardware(self) -> str:
        """The target: ``ai200`` or ``ai100`` (``2.0`` is ai100's old spelling)."""
        return AI200 if self.language.aic_hw_version == AI200 else AI100

    def hardware_record(self) -> dict[str, Any]:
        """The manifest's ``hardware`` entry: the target and, for ``auto``, how it was found."""
        requested = AUTO if self.detection else None
        record: dict[str, Any] = {"aic_hw_version": self.hardware, "requested": requested}
        if self.detection is not None:
            record["detection"] = self.detection.to_dict()
        return record

    def program(self, name: str) -> ProgramOptions:
        """Options of ``name`` (``vision``/``language``, or the directory names ``vision``/``lang``)."""
        if name == VISION:
            return self.vision
        if name in (LANGUAGE, PROGRAM_DIRS[LANGUAGE]):
            return self.language
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dictionary, keyed by YAML section name."""
        data: dict[str, Any] = {VISION: self.vision.to_dict(), LANGUAGE: self.language.to_dict()}
        if self.comp_ctx_lengths is not None:
            data[CCL_KEY] = asdict(self.comp_ctx_lengths)
        if self.calibration is not None:
            data[CALIBRATION_KEY] = asdict(self.calibration)
        if self.max_activation_bytes != DEFAULT_MAX_ACTIVATION_BYTES:
            data[ACTIVATION_KEY] = self.max_activation_bytes
        return data


ACTIVATION_KEY = "max_activation_bytes"


def parse_max_activation_bytes(value: Any, path: str) -> tuple[int | None, list[str]]:
    """Read ``max_activation_bytes``: a positive number of bytes, or ``null`` for no bound."""
    if value is None:
        return None, []
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return DEFAULT_MAX_ACTIVATION_BYTES, [
            f"{path}: must be a positive number of bytes (268435456 is 256 MiB) or null, not {shown(value)}"
        ]
    return value, []


CCL_KEY = "comp_ctx_lengths"
CCL_PHASES = ("prefill", "decode")


def parse_comp_ctx_lengths(value: Any, path: str) -> tuple[CompCtxLengths | None, list[str]]:
    """Read ``comp_ctx_lengths: {prefill: [...], decode: [...]}``.

    Two non-empty, strictly increasing lists of positive integers; the range against ``ctx_len`` is
    checked by the spec loader.
    """
    if not isinstance(value, Mapping):
        return None, [f"{path}: must be a mapping with prefill and decode lists"]
    problems = [
        f"{path}.{key}: unknown key; allowed: prefill, decode" for key in value if key not in CCL_PHASES
    ]
    lists: dict[str, tuple[int, ...]] = {}
    for phase in CCL_PHASES:
        here = f"{path}.{phase}"
        items = value.get(phase)
        if items is None:
            problems.append(f"{here}: missing (a list of context lengths)")
            continue
        if not isinstance(items, list) or not items:
            problems.append(f"{here}: must be a non-empty list of positive integers")
            continue
        bad = [item for item in items if _positive_int(item)]
        if bad:
            problems.append(f"{here}: must be positive integers, got {bad[0]!r}")
            continue
        if any(later <= earlier for earlier, later in zip(items, items[1:])):
            problems.append(f"{here}: must be strictly increasing (sorted, no repeats), got {items}")
            continue
        lists[phase] = tuple(items)
    if problems:
        return None, problems
    return CompCtxLengths(lists["prefill"], lists["decode"]), []


# ---- validation ----


def _positive_int(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "must be a positive integer"
    return None


def _cores(value: Any) -> str | None:
    problem = _positive_int(value)
    if problem is None and value > MAX_CORES_PER_DEVICE:
        return f"must be at most {MAX_CORES_PER_DEVICE} (cores of one device)"
    return problem


def _optional_positive_int(value: Any) -> str | None:
    return None if value is None else _positive_int(value)


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _choice(choices: tuple[str, ...]):
    def check(value: Any) -> str | None:
        if isinstance(value, str) and value in choices:
            return None
        return "must be one of " + ", ".join(choices) + f" (got {shown(value)})"

    return check


def _timeout(value: Any) -> str | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        return "must be a positive number of seconds"
    return None


def _sampler(value: Any) -> str | None:
    allowed = tuple(SamplerOptions().to_dict())
    if not isinstance(value, Mapping):
        return "must be a mapping with " + ", ".join(allowed) + " (each optional)"
    problems = [f"{key}: unknown key; allowed: {', '.join(allowed)}" for key in value if key not in allowed]
    if "max_top_k_ids" in value and _positive_int(value["max_top_k_ids"]):
        problems.append(f"max_top_k_ids: must be a positive integer (got {shown(value['max_top_k_ids'])})")
    problems += [
        f"{key}: must be true or false (got {shown(value[key])})"
        for key in ("return_pdfs", "guided_decoding")
        if key in value and not isinstance(value[key], bool)
    ]
    return "; ".join(problems) or None


def sampler_options(value: Mapping[str, Any]) -> SamplerOptions:
    """``compile.language.sampler`` from a mapping of its keys as the spec names them.

    Raises:
        ValueError: One line naming what is wrong (the spec's own check).
    """
    problem = _sampler(value)
    if problem:
        raise ValueError(problem)
    return SamplerOptions(**value)


def _node_precision(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    return f"must be {NODE_PRECISION_AUTO}, {NODE_PRECISION_NONE} or the path of a node precision file"


_CHECKS = {
    "num_cores": _cores,
    "num_devices": _positive_int,
    "mxfp6_matmul": _boolean,
    "convert_to_fp16": _boolean,
    "mos": _optional_positive_int,
    "ols": _optional_positive_int,
    "depth_first": _boolean,
    "aic_hw_version": _choice(AIC_HW_VERSIONS),
    "kv_cache_dtype": _choice(KV_CACHE_DTYPES),
    "state_dtype": _choice(STATE_DTYPES),
    "timeout": _timeout,
    "node_precision": _node_precision,
    "split_model_io": _boolean,
    "allow_mxint8_mdp_io": _boolean,
    "split_retained_state_io": _boolean,
    "sampler": _sampler,
    "subfunctions": _boolean,
}
assert set(_CHECKS) == {f.name for f in fields(ProgramOptions)}, "every option needs a check"
PROGRAM_KEYS = tuple(_CHECKS)


def _normalize(value: Any, key: str) -> Any:
    # YAML may spell "2.0" as a float; accept it rather than make users quote a version.
    if key == "aic_hw_version" and isinstance(value, float) and not isinstance(value, bool):
        return f"{value:.1f}"
    if key == "timeout" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _read_program(data: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> tuple[dict, list[str]]:
    """Checked option values of one mapping; unknown keys and bad values become problems."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key not in allowed:
            if key in LANGUAGE_ONLY_KEYS:
                problems.append(f"{path}.{key}: applies to the language program only")
            else:
                problems.append(f"{path}.{key}: unknown key; allowed: " + ", ".join(allowed))
            continue
        value = _normalize(value, key)
        problem = _CHECKS[key](value)
        if problem:
            problems.append(f"{path}.{key}: {problem}")
        else:
            values[key] = SamplerOptions(**value) if key == "sampler" else value
    return values, problems


def parse_compile_options(
    data: Mapping[str, Any] | None, path: str = "compile", detect=None
) -> tuple[CompileOptions, list[str]]:
    """Validate a spec's ``compile:`` section.

    Keys at the top level are defaults for both programs (language-only keys such as
    ``kv_cache_dtype`` apply to the language program); ``vision:`` and ``language:`` override them.

    Args:
        data: The parsed section; ``None`` (section absent) gives the defaults.
        path: YAML path of the section, used as the prefix of every problem.
        detect: Called (no arguments) for an :class:`HwDetection` when ``aic_hw_version`` is
            ``auto``; without it ``auto`` resolves to ``ai100`` (no detection asked).

    Returns:
        The options (defaults where a value was missing or invalid) and every problem found, each
        as ``"<yaml path>: <what is wrong>"``. An empty list means the section is valid.
    """
    if data is None:
        return CompileOptions(), []
    if not isinstance(data, Mapping):
        return CompileOptions(), [f"{path}: must be a mapping of compiler options"]
    problems: list[str] = []
    ccl = None
    if data.get(CCL_KEY) is not None:
        ccl, found = parse_comp_ctx_lengths(data[CCL_KEY], f"{path}.{CCL_KEY}")
        problems += found
    calibration = None
    if data.get(CALIBRATION_KEY) is not None:
        calibration, found = parse_calibration(data[CALIBRATION_KEY], f"{path}.{CALIBRATION_KEY}")
        problems += found
    bound = DEFAULT_MAX_ACTIVATION_BYTES
    if ACTIVATION_KEY in data:
        bound, found = parse_max_activation_bytes(data[ACTIVATION_KEY], f"{path}.{ACTIVATION_KEY}")
        problems += found
    sections = (VISION, LANGUAGE, CCL_KEY, CALIBRATION_KEY, ACTIVATION_KEY)
    shared_data = {k: v for k, v in data.items() if k not in sections}
    shared, found = _read_program(shared_data, path, PROGRAM_KEYS + sections)
    problems += found
    vision_keys = tuple(k for k in PROGRAM_KEYS if k not in LANGUAGE_ONLY_KEYS)
    given: dict[str, dict[str, Any]] = {}
    for name, allowed in ((VISION, vision_keys), (LANGUAGE, PROGRAM_KEYS)):
        section = data.get(name)
        if section is None:
            section = {}
        elif not isinstance(section, Mapping):
            problems.append(f"{path}.{name}: must be a mapping of compiler options")
            section = {}
        own, found = _read_program(section, f"{path}.{name}", allowed)
        problems += found
        given[name] = {k: v for k, v in shared.items() if k in allowed} | own
    from qeff_vision.spec.hardware_rules import hardware_rules, resolve_hardware

    detection, found = resolve_hardware(given, path, detect)
    problems += found
    programs: dict[str, ProgramOptions] = {}
    for name, default in ((VISION, ProgramOptions()), (LANGUAGE, _default_language())):
        merged = given[name]
        found = hardware_rules(merged, f"{path}.{name}" if name in data else path)
        problems += [p for p in found if p not in problems]  # a shared key's problem once
        programs[name] = replace(default, **merged)
    options = CompileOptions(
        vision=programs[VISION],
        language=programs[LANGUAGE],
        comp_ctx_lengths=ccl,
        calibration=calibration,
        max_activation_bytes=bound,
        detection=detection,
    )
    return options, problems
