"""What each deployment mode is: the one table spec/, compile/ and runtime/ read (pure data).

``dual`` is the vision program plus one language program; ``single`` one program holding encoder
and decoder; ``disaggregated`` the vision program plus ``lang_prefill`` and ``lang_decode``, both
compiled from the one language graph (docs/design.md "Deployment modes"). Everything that differs
between modes (which programs a compile writes, the spec keys a mode allows, the compile flags it
defaults, what the runtime can do with its programs) is a field of its :class:`DeploymentMode` in
:data:`MODES`; other modules ask the table, never compare mode names (tests/test_runner_composition.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

DUAL = "dual"
SINGLE = "single"
DISAGGREGATED = "disaggregated"
LANG_PREFILL = "lang_prefill"
LANG_DECODE = "lang_decode"
#: A single program's keep specializations bind every image symbol to this (the compiler takes
#: positive values only; the host's placeholder image has these sides): no encoder runs there.
# ref: QEfficient's single QPC encodes in every specialization; ours only where the side is larger.
KEEP_SIDE = 1


@dataclass(frozen=True, eq=False)
class DeploymentMode:
    """One deployment mode (spec key ``deployment``), as every stage reads it.

    Attributes:
        name: The spec's ``deployment`` value.
        programs: Program directory under OUT -> its ``compile:`` section, in compile order.
        vision_program: The program the vision specializations are read from (a single program's
            encode entries stand for them).
        language_program: The program whose compile options apply to the language session the
            runtime opens (the one that decodes).
        phase_programs: (prefill, decode) programs of a language graph compiled twice; empty when
            the language graph is one program.
        encoder_inside: The vision encoder is composed into the language program.
        one_sequence: Serves one sequence: batch 1, no ``full_batch_size`` (the runtime's batched
            engine does not serve it).
        keeps_prefix: A conversation's turn may keep the prefix the language program holds.
        video: Takes clips (``vision.videos``).
        patch_buckets: Takes a patch-bucket vision program (``vision.patch_buckets``).
        decode_shaped_tail: A prompt's tokens past the last prefill CCL may go one per call
            through the decoding program's decode specializations.
        sampler: May compile the on-device sampler into its language program(s).
        pooling: May build a pooling task's programs (``task: embed`` / ``score``).
        vllm_forms: Compile writes vLLM's serve forms (else the programs' command lines are the
            golden files).
        kv_prefix: Takes ``kv_cache_prefix`` and ``retain_full_kv`` (the names and lengths of the
            KV one program hands to another).
        flag_defaults: Program directory -> default of each deployment compile flag the spec
            leaves unset (ref: the Cloud AI disaggregated-serving launcher's compile arguments).
        feature: The family feature (a :class:`~qeff_vision.families.features.Features` cell)
            saying whether a family can be deployed so; None: every family can.
    """

    name: str
    programs: Mapping[str, str]
    vision_program: str = "vision"
    language_program: str = "lang"
    phase_programs: tuple[str, ...] = ()
    encoder_inside: bool = False
    one_sequence: bool = False
    keeps_prefix: bool = True
    video: bool = True
    patch_buckets: bool = True
    decode_shaped_tail: bool = True
    sampler: bool = True
    pooling: bool = False
    vllm_forms: bool = False
    kv_prefix: bool = False
    flag_defaults: Mapping[str, Mapping[str, bool]] = field(default_factory=dict)
    feature: str | None = None


#: Every deployment mode, by its spec name. A new mode is one entry here (and its runtime object).
MODES: Mapping[str, DeploymentMode] = MappingProxyType(
    {
        mode.name: mode
        for mode in (
            DeploymentMode(DUAL, {"vision": "vision", "lang": "language"}, pooling=True, vllm_forms=True),
            DeploymentMode(
                SINGLE,
                {"lang": "language"},
                vision_program="lang",
                encoder_inside=True,
                one_sequence=True,
                video=False,
                patch_buckets=False,
                decode_shaped_tail=False,  # its runners plan every token as prefill
                sampler=False,
                feature="single_program",
            ),
            DeploymentMode(
                DISAGGREGATED,
                {"vision": "vision", LANG_PREFILL: "language", LANG_DECODE: "language"},
                language_program=LANG_DECODE,
                phase_programs=(LANG_PREFILL, LANG_DECODE),
                keeps_prefix=False,  # the prefill program never holds the reply
                # One-token calls go to the decode program, which holds no prefill cache before the hand-off.
                decode_shaped_tail=False,
                kv_prefix=True,
                flag_defaults={
                    "vision": {"split_model_io": True},
                    LANG_PREFILL: {"split_model_io": True, "allow_mxint8_mdp_io": True},
                    LANG_DECODE: {
                        "split_model_io": True,
                        "allow_mxint8_mdp_io": True,
                        "split_retained_state_io": True,
                    },
                },
                feature="disaggregated",
            ),
        )
    }
)
#: The spec's ``deployment`` values.
DEPLOYMENTS = tuple(MODES)
#: Program directory names under OUT per mode, in compile order; each maps to its compile: section.
PROGRAMS: dict[str, Mapping[str, str]] = {name: mode.programs for name, mode in MODES.items()}
