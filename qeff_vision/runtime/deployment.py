"""Deployment modes as runtime objects: one per mode, registered once, asked instead of type checks.

What a mode is (its programs, which of them decodes, batching, kept prefixes, clips, the encoder's
place) is its row of the one mode table, :data:`qeff_vision.contract.deployment_programs.MODES`,
which spec/ and compile/ read too. The object of a mode here adds how the runtime opens its
programs, where a language call goes (one program, or prefill and decode programs of one graph)
and where per-sequence state lives while the batched engine serves requests (its slots).

The rest of the runtime asks a generator's :attr:`~qeff_vision.runtime.generator.Generator.deployment`
(capabilities, slots, the decoding program's specializations, KV hand-offs); the one place that
recognises a program's kind is :func:`deployment_of`, here. A new mode is one row of the table, a
subclass naming it and one entry of :data:`DEPLOYMENTS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qeff_vision import symbols
from qeff_vision.contract.deployment_programs import KEEP_SIDE, MODES, DeploymentMode
from qeff_vision.contract.language_io import Role
from qeff_vision.errors import UserError
from qeff_vision.export_record import read_export
from qeff_vision.graph_file import described_values
from qeff_vision.runtime.backends import backend_of
from qeff_vision.runtime.disaggregated import PhaseRouter, phase_programs
from qeff_vision.runtime.slots import BatchedSlots, SequentialSlots
from qeff_vision.spec.deployment import DISAGGREGATED, DUAL, SINGLE
from qeff_vision.spec.table import LANGUAGE_SYMBOLS
from qeff_vision.symbols import NUM_IMAGES, PIXEL_SIDE

if TYPE_CHECKING:
    from qeff_vision.runtime.artifacts import Artifacts
    from qeff_vision.runtime.generator import Generator

Specializations = tuple[dict[str, int], ...]


def read_symbols(entries: Any, where: str) -> Specializations:
    """Symbol values of a manifest program's ``specializations`` entries.

    Raises:
        UserError: The entries are not ``[{"name", "symbols"}]``.
    """
    try:
        return tuple({k: int(v) for k, v in entry["symbols"].items()} for entry in entries)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"{where}: specializations are not [{{'name', 'symbols'}}] entries ({exc})") from exc


def _program_symbols(manifest: Mapping[str, Any], program: str, where: str) -> Specializations:
    return read_symbols(manifest["programs"][program].get("specializations") or [], where)


def image_specializations(specializations, family: Any = None) -> tuple[dict[str, int], ...]:
    """The image symbols of a single program's encode entries, named as the vision program's.

    ``num_images`` is the vision graph's image count (``family.vision_images_symbol``); keep
    entries (every image symbol 1) and duplicates are dropped. With ``family``, only symbols of
    its vision inputs count (mllama's entries also bind the mask's ``max_num_images`` and the
    K/V's ``cross_states``, both language symbols there). What the image fitter checks a
    resolution against.
    """
    count = family.vision_images_symbol if family is not None else symbols.BATCH_SIZE
    wanted = None
    if family is not None:
        on_inputs = {name for axes in family.vision_input_axes.values() for name in axes.values()}
        wanted = (on_inputs - {count}) | {NUM_IMAGES, PIXEL_SIDE}
    found: list[dict[str, int]] = []
    for entry in specializations:
        images = {
            name: value
            for name, value in entry.items()
            if name not in LANGUAGE_SYMBOLS and (wanted is None or name in wanted)
        }
        if not images or all(value == KEEP_SIDE for name, value in images.items() if name != NUM_IMAGES):
            continue
        vision = {
            (count if name == NUM_IMAGES else name): value
            for name, value in images.items()
            if name != PIXEL_SIDE
        }
        if vision not in found:
            found.append(vision)
    return tuple(found)


class Deployment:
    """One deployment mode (see the module docstring): its row of the mode table and its behaviour.

    What the mode is (programs, capabilities) is its :class:`~qeff_vision.contract.deployment_programs.
    DeploymentMode` in :data:`~qeff_vision.contract.deployment_programs.MODES`, read by spec and
    compile too; a subclass names its row (:attr:`table`) and adds how the runtime opens and drives
    its programs.

    Attributes:
        table: The mode's row of the table.
    """

    table: DeploymentMode = MODES[DUAL]

    @property
    def name(self) -> str:
        """The spec's ``deployment`` value."""
        return self.table.name

    @property
    def language_program(self) -> str:
        """The manifest program whose compile options apply to the language session the runtime opens."""
        return self.table.language_program

    @property
    def vision_program(self) -> str:
        """The manifest program the vision specializations are read from."""
        return self.table.vision_program

    @property
    def encoder_inside(self) -> bool:
        """The vision encoder is composed into the language program (runners of the single form)."""
        return self.table.encoder_inside

    @property
    def batching(self) -> bool:
        """Serves several requests through the batched engine (``run --requests``)."""
        return not self.table.one_sequence

    @property
    def keeps_prefix(self) -> bool:
        """A conversation's turn may keep the prefix the language program holds."""
        return self.table.keeps_prefix

    @property
    def video(self) -> bool:
        """Takes clips."""
        return self.table.video

    @property
    def decode_shaped_tail(self) -> bool:
        """A prompt's tokens past the last prefill CCL may go one per decode-shaped call."""
        return self.table.decode_shaped_tail

    def specializations(
        self, manifest: Mapping[str, Any], where: str, family: Any
    ) -> tuple[Specializations, Specializations, tuple[Specializations, ...]]:
        """(vision, language, per-phase language) specializations the manifest records."""
        vision = _program_symbols(manifest, self.vision_program, where)
        return vision, _program_symbols(manifest, self.language_program, where), ()

    def open_programs(
        self, artifacts: Artifacts, precision: str, plans: Mapping[str, Any]
    ) -> tuple[Any, Any]:
        """(vision, language) sessions over the artifacts, at ``precision``.

        Args:
            artifacts: The compile output.
            precision: ``fp32``, ``device`` or ``device-mx`` (checked by the caller).
            plans: Program -> its fp32 node list at device precision (None: fp32 graph), and
                ``"mx"``: the language program's microscaling emulation or None.
        """
        artifacts.program_backend.check_available(artifacts.language_path)
        vision = artifacts.program_backend.open_program(
            artifacts.vision_path,
            artifacts.vision_specializations,
            lambda: _recorded_io(artifacts)["vision"],
            fp32_values=plans.get(self.vision_program),
        )
        return vision, self._language_program(artifacts, plans, lambda: _recorded_io(artifacts)["lang"])

    def _language_program(self, artifacts: Artifacts, plans: Mapping[str, Any], describe) -> Any:
        """The language program on the artifacts' backend (``describe()``: its IO, for a device)."""
        return artifacts.program_backend.open_program(
            artifacts.language_path,
            artifacts.language_specializations,
            describe,
            fp32_values=plans.get(self.language_program),
            mx=plans.get("mx"),
        )

    def engine_slots(self, generator: Generator, full_batch_size: int) -> Any:
        """The batched engine's slots: one batched cache (``batch_index``), else a cache per slot."""
        batched = generator.io.has(Role.KV_SLOT)
        return (BatchedSlots if batched else SequentialSlots)(generator, full_batch_size)

    def decode_specializations(self, language: Any) -> Sequence[Mapping[str, Any]] | None:
        """The specializations of the program that decodes (the engine's slot count is read there)."""
        return language.specializations

    def handoffs(self, language: Any) -> tuple[int, int] | None:
        """(prefill KV hand-offs into decode slots, their bytes); None for a mode without them."""
        return None

    def holds_turn(self, language: Any, held_calls: int) -> bool:
        """Whether the language program still holds what a kept turn left (``held_calls``: its calls then).

        A device keeps the caches resident: they are the held ones only if nothing ran since.
        """
        return self.keeps_prefix and backend_of(language).holds_turn(language.calls, held_calls)


class Dual(Deployment):
    """A vision program and a language program (prefill and decode specializations)."""

    table = MODES[DUAL]


class Disaggregated(Deployment):
    """Vision, ``lang_prefill`` and ``lang_decode`` (:mod:`qeff_vision.runtime.disaggregated`).

    The language program is a :class:`~qeff_vision.runtime.disaggregated.PhaseRouter`: seq_len > 1
    calls go to the prefill program, one-token calls to the decode program; the engine's slots
    prefill into a batch-1 cache and hand the KV over to a decode slot. The prefill program never
    holds the reply, so no prefix is kept.
    """

    table = MODES[DISAGGREGATED]

    def specializations(self, manifest, where, family):
        """Both language programs' specializations (prefill first), and per phase."""
        vision = _program_symbols(manifest, self.vision_program, where)
        phases = tuple(_program_symbols(manifest, name, where) for name in self.table.phase_programs)
        if not all(phases):
            raise UserError(f"{where}: a program has no specializations")
        return vision, phases[0] + phases[1], phases

    def open_programs(self, artifacts, precision, plans):
        """The vision session and a :class:`PhaseRouter` over one language session (onnxruntime only).

        Raises:
            UserError: A ``qaic`` artifact: the KV transfer between device programs is the
                serving stack's.
        """
        artifacts.program_backend.check_state_transfer(
            f"{artifacts.out_dir}: a disaggregated qaic artifact keeps each program's KV on its own "
            "device; the prefill-to-decode KV transfer is the serving stack's (vLLM), not this runtime's"
        )
        vision, language = super().open_programs(artifacts, precision, plans)
        return vision, phase_programs(language, *artifacts.phase_specializations)

    def engine_slots(self, generator, full_batch_size):
        """The router's slots: prefill into a batch-1 cache, handed over to the decode slot."""
        return generator.language.engine_slots(generator, full_batch_size)

    def decode_specializations(self, language):
        """The decode program's (its prefill program binds ``full_batch_size`` 1)."""
        return language.decode_specializations

    def handoffs(self, language):
        """The router's hand-off count and bytes."""
        return language.handoffs, language.handoff_bytes


class Single(Deployment):
    """One program ``lang``: the encoder composed into the decoder (:mod:`qeff_vision.runtime.single`).

    Its encode entries stand for the vision program's specializations; both places hold the same
    session. One sequence's image rows live in the program: no batching, no clips.
    """

    table = MODES[SINGLE]

    def specializations(self, manifest, where, family):
        """The program's entries; the vision specializations are its encode entries' image symbols."""
        language = _program_symbols(manifest, self.language_program, where)
        return image_specializations(language, family), language, ()

    def open_programs(self, artifacts, precision, plans):
        """One session, in both places (its encoder is counted by the single runner)."""
        artifacts.program_backend.check_available(artifacts.language_path)
        language = self._language_program(artifacts, plans, lambda: single_program_io(artifacts))
        return language, language

    def engine_slots(self, generator, full_batch_size):
        """None: the batched engine does not serve a single program.

        Raises:
            UserError: Always.
        """
        raise UserError(
            "deployment single serves one sequence at a time (batch 1, its image rows retained in "
            "the program); serve batches from a dual or disaggregated compile"
        )


def _recorded_io(artifacts: Artifacts) -> Mapping[str, Any]:
    """The programs' IO the export recorded (read again here only to say why it is missing)."""
    return (artifacts.export_record or read_export(artifacts.export_dir))["programs"]


def single_program_io(artifacts: Artifacts) -> dict[str, dict[str, dict[str, Any]]]:
    """The composed single program's ``inputs`` / ``outputs`` (dtype, shape), read from its ONNX.

    export.json describes the vision and language graphs, not their composition
    (:mod:`qeff_vision.compile.single_program`), so the graph itself is read (no weights loaded).

    Raises:
        UserError: The manifest names no ONNX for ``lang`` or it cannot be read.
    """
    import onnx

    recorded = artifacts.manifest["programs"]["lang"].get("onnx")
    if not recorded:
        raise UserError(f"{artifacts.out_dir / 'manifest.json'}: the lang program records no ONNX")
    path = Path(recorded)
    path = path if path.is_absolute() else artifacts.out_dir / path
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise UserError(f"{path}: cannot read the single program's graph ({exc})") from None
    return {"inputs": described_values(graph.input), "outputs": described_values(graph.output)}


#: Every deployment mode the runtime runs, by its spec name. A new mode registers here.
DEPLOYMENTS: dict[str, Deployment] = {mode.name: mode for mode in (Dual(), Disaggregated(), Single())}


def deployment_named(name: str, where: str) -> Deployment:
    """The registered mode called ``name``.

    Raises:
        UserError: The runtime does not run that mode.
    """
    if name not in DEPLOYMENTS:
        raise UserError(f"{where}: the runtime does not run deployment {name!r} yet")
    return DEPLOYMENTS[name]


def deployment_of(language: Any) -> Deployment:
    """The mode of a language program opened without its artifacts (tests, calibration, a bare export).

    A :class:`~qeff_vision.runtime.disaggregated.PhaseRouter` is the disaggregated pair; any other
    program the dual language program. (A single program's runner states its own mode.)
    """
    return DEPLOYMENTS[DISAGGREGATED if isinstance(language, PhaseRouter) else DUAL]
