"""ai200 device precision (bf16 emulation) against transformers run in bf16, teacher-forced (issue 49).

Per family, the tiny checkpoint in bfloat16 is exported with bf16 weights (rotary cos/sin read
from bf16 position tables, qeff_vision/export/rotary_tables.py) and run at device precision as an
ai200 program computes (every float value rounded to bf16, nearest even; no node kept fp32).
transformers runs the same checkpoint teacher-forced on our tokens twice: in fp32, and in bf16 as
``from_pretrained(dtype=torch.bfloat16)`` computes (rotary frequencies fp32,
``reference.model_in_dtype``). The yardstick is transformers' own bf16 deviation from its fp32:
``y`` = the worst step's max |logit difference| over the fp32 row's range. The bound, per family:

* ours is within ``K y`` of fp32, K = 2. Both sides are bf16 roundings of the same fp32
  computation, but ours rounds after every ONNX node where transformers rounds once per module
  (its norms and softmax are fp32 inside): up to about 4x as many roundings, whose independent
  errors add to about sqrt(4) = 2x transformers' deviation;
* hence, by the triangle inequality, ours is within ``(K + 1) y`` = BOUND ``y`` of transformers
  bf16 (``d(ours, tf_bf16) <= d(ours, fp32) + d(fp32, tf_bf16)``), asserted as the acceptance line
  states it;
* our token is transformers bf16's argmax wherever its top-1/top-2 margin exceeds twice the
  deviation;
* an expert choice decided by rounding may go either way (tests/routing_ties.py): where a step
  is past the bound, the references are rerun with one routing tie of that step taken the other
  way (the fp32 margin between the last chosen expert and the runner-up smaller than transformers'
  own bf16 run moves it), and every step must then be within the same bound.

Measured over the 15 tiny families (2026-11-29, docs/benchmarks/ai200_numerics.md): ``y`` from
2.7e-3 (LLaVA) to 1.9e-2 (Gemma 4); ``d(ours, fp32) / y`` up to 1.34 (Gemma 3) and
``d(ours, tf_bf16) / y`` from 0.62 to 1.63. Llama 4's last decode step was at 6.4 y: its last
MoE layer's top-1 router logits were expert 2 at -0.16477 and expert 3 at -0.17059 in fp32 (a
5.8e-3 margin), a difference transformers' own bf16 run moves by 2.5e-2; ours took expert 3.
With expert 3 in the references, every step is within 1.36 y of fp32 and 1.21 y of transformers
bf16. Computing the router (logits, top-k, sigmoid) in fp32 does not change it (6.35 y either
way): the near-tie is in the router's input, the bf16 residual stream. The bound used to be 3e-2
of the range, set after seeing results, when the session had lost the bf16 grid and emulated fp16
(numerics/device.py ``_expanded``).

The default tier runs Qwen2.5-VL (M-RoPE, token merge), mllama (cross-attention) and Llama 4 (its
routing tie); ``-m slow`` every family. Then ``run --precision device`` on a compiled ai200
artifact: the sessions it opens are the bf16 emulation (its first step's logits within
CHUNKING_TOLERANCE of the export's bf16 run, the compiled buckets chunking the prompt
differently) and not the fp32 run.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from qeff_vision.cli import main
from qeff_vision.exporter import export_model
from qeff_vision.families import all_families
from qeff_vision.numerics.device import Bf16Values, round_to
from qeff_vision.reference import reference_teacher_forced
from qeff_vision.runtime.artifacts import device_plan, generator_for_artifacts, load_artifacts
from qeff_vision.runtime.generate import generator_for_export
from qeff_vision.runtime.language_shape import LanguageShape
from qeff_vision.runtime.planner import PrefillBucket
from tests import helpers
from tests.compile_fixtures import write_spec
from tests.routing_ties import routing_ties, swapped_references
from tests.test_ai200_families import bf16_checkpoint

FAMILIES = [family.name for family in all_families()]
K = 2.0  # d(ours, fp32) <= K * y, y = d(transformers bf16, transformers fp32)
BOUND = K + 1  # d(ours, transformers bf16) <= BOUND * y (triangle inequality)
# Known failures (strict, so a fix shows). None is left: Llama 4's decode step at 6.4 y was an
# expert choice decided by rounding (see the module docstring), now compared as such.
OPEN: dict[str, str] = {}
# Routing ties of the first step past the bound tried, closest first (each costs two reference runs).
MAX_TIES_TRIED = 4
# Two bf16 emulations chunking the prompt differently: each within 1.5e-2 of fp32 on these
# checkpoints (y above), so within twice that of each other.
CHUNKING_TOLERANCE = 3e-2
DEFAULT_TIER = ("qwen2_5_vl", "mllama", "llama4")
NEW_TOKENS = 9
BF16 = {"vision": Bf16Values(), "lang": Bf16Values()}


@pytest.fixture(scope="module")
def bf16_export(tiny_checkpoint, tmp_path_factory):
    """``bf16_export(family) -> (checkpoint, export dir)``: bf16 checkpoint, bf16-weight export."""
    built: dict[str, tuple] = {}

    def build(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(f"ai200-{family}")
            checkpoint = bf16_checkpoint(tiny_checkpoint(family), root / "checkpoint")
            export = export_model(checkpoint, root / "export", progress=None, weight_dtype="bfloat16")
            built[family] = (checkpoint, export.out_dir)
        return built[family]

    return build


def _prompt(processor, size=(100, 150)):
    image = helpers.image(*size)
    return helpers.process(processor, helpers.user_turn("<image>", "Describe this image."), [image])


def _bf16_run(export, inputs, plans=BF16):
    length = inputs["input_ids"].shape[1]
    bucket = PrefillBucket(length + 3, length + 3)
    generator = generator_for_export(
        export, LanguageShape((bucket,), bucket.vision_size, length + 64), fp32_values=plans
    )
    return generator.generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS, keep_logits=True)


def _relative(rows, references) -> float:
    """The worst step's max |difference| over the reference row's range."""
    return max(float(np.abs(a - b).max() / (b.max() - b.min())) for a, b in zip(rows, references))


def _families():
    """Every family; slow outside the default tier, expected to fail where OPEN says why."""
    params = []
    for name in FAMILIES:
        marks = [] if name in DEFAULT_TIER else [pytest.mark.slow]
        if name in OPEN:
            marks.append(pytest.mark.xfail(strict=True, reason=OPEN[name]))
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.mark.parametrize("family", _families())
def test_ai200_device_precision_matches_transformers_in_bf16(family, bf16_export):
    checkpoint, export = bf16_export(family)
    model, processor = helpers.load_hf(checkpoint)
    inputs = _prompt(processor)
    result = _bf16_run(export, inputs)
    reference = reference_teacher_forced(model, inputs, result.tokens, "bfloat16")
    fp32 = reference_teacher_forced(model, inputs, result.tokens)
    assert len(reference) == len(fp32) == len(result.tokens) == len(result.logits)
    assert all(np.isfinite(ours).all() for ours in result.logits)
    # The device's logits are bf16 values (a session that lost the bf16 plan emulates fp16).
    assert all(np.array_equal(ours, round_to(ours, TensorProto.BFLOAT16)) for ours in result.logits)
    yardstick = _relative(reference, fp32)
    assert yardstick > 0, "transformers bf16 must differ from fp32 (else the model did not run in bf16)"
    ours_fp32, ours_bf16 = _relative(result.logits, fp32), _relative(result.logits, reference)
    figures = f"y={yardstick:.2e} d(ours, fp32)={ours_fp32:.2e} d(ours, tf bf16)={ours_bf16:.2e}"
    if ours_fp32 > K * yardstick or ours_bf16 > BOUND * yardstick:
        # A step past the bound: an expert choice decided by rounding (tests/routing_ties.py) may
        # have gone the other way; the references then take it the other way too, bound unchanged.
        tie, fp32, reference = _routing_tie(model, inputs, result, yardstick, fp32, reference)
        ours_fp32, ours_bf16 = _relative(result.logits, fp32), _relative(result.logits, reference)
        figures += f"; {tie} taken the other way: {ours_fp32:.2e}, {ours_bf16:.2e}"
    assert ours_fp32 <= K * yardstick, figures
    assert ours_bf16 <= BOUND * yardstick, figures
    for step, (ours, ref) in enumerate(zip(result.logits, reference)):
        deviation = float(np.abs(ours - ref).max())
        top = np.sort(ref)[-2:]
        if top[1] - top[0] > 2 * deviation:
            assert result.tokens[step] == int(ref.argmax()), step


def _routing_tie(model, inputs, result, yardstick, fp32, reference):
    """The routing tie of the first step past the bound that, taken the other way, brings every step
    within it: ``(tie, fp32 rows, bf16 rows)`` of the swapped references, or ``(None, ...)`` of the
    plain ones when no tie does (the caller's bound then fails)."""
    failing = next(
        step
        for step, (ours, exact, rounded) in enumerate(zip(result.logits, fp32, reference))
        if _relative([ours], [exact]) > K * yardstick or _relative([ours], [rounded]) > BOUND * yardstick
    )
    ties = [tie for tie in routing_ties(model, inputs, result.tokens) if tie.step == failing]
    for tie in ties[:MAX_TIES_TRIED]:
        swapped_fp32, swapped_bf16 = swapped_references(model, inputs, result.tokens, tie)
        if (
            _relative(result.logits, swapped_fp32) <= K * yardstick
            and _relative(result.logits, swapped_bf16) <= BOUND * yardstick
        ):
            return tie, swapped_fp32, swapped_bf16
    return None, fp32, reference


def test_device_session_keeps_the_bf16_grid(bf16_export, monkeypatch):
    """The session's rewrite rounds to bf16 for a Bf16Values plan, to fp16 for a plain one."""
    from qeff_vision.numerics import device

    _, export = bf16_export("qwen2_5_vl")
    grids = []
    rewrite = device.device_graph

    def recorded(model, fp32_values=(), *args, **kwargs):
        grids.append(device.grid_of(fp32_values))
        return rewrite(model, fp32_values, *args, **kwargs)

    monkeypatch.setattr(device, "device_graph", recorded)
    device.device_session(export / "lang" / "model.onnx", Bf16Values())
    device.device_session(export / "lang" / "model.onnx", [])
    assert grids == [TensorProto.BFLOAT16, TensorProto.FLOAT16]


def test_run_precision_device_on_an_ai200_artifact_is_the_bf16_emulation(bf16_export, tmp_path, capsys):
    family = "qwen2_5_vl"
    checkpoint, export = bf16_export(family)
    spec = write_spec(
        tmp_path / "ai200.yaml",
        model=str(checkpoint),
        config=None,
        ctx_len=512,
        compile_section={"aic_hw_version": "ai200"},
    )
    out = tmp_path / "out"
    code = main(["compile", str(spec), "-o", str(out), "--backend", "onnxruntime", "--export", str(export)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "device precision (bf16, every value rounded) vs fp32" in captured.out
    artifacts = load_artifacts(out)
    assert isinstance(device_plan(artifacts, "lang"), Bf16Values)
    _, processor = helpers.load_hf(checkpoint)
    inputs = _prompt(processor, (224, 224))  # a compiled resolution
    generator = generator_for_artifacts(artifacts, precision="device")
    ours = generator.generate(helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS, keep_logits=True)
    # The compiled buckets (64, 128) chunk the prompt differently from the export run's one bucket,
    # so logits agree to bf16 rounding, not bit for bit; fp32 is a different run altogether.
    emulated = _bf16_run(export, inputs)
    plain = generator_for_artifacts(artifacts, precision="fp32").generate(
        helpers.as_numpy(inputs), max_new_tokens=NEW_TOKENS, keep_logits=True
    )
    first = ours.logits[0]
    scale = float(first.max() - first.min())
    assert float(np.abs(first - emulated.logits[0]).max()) <= CHUNKING_TOLERANCE * scale
    assert float(np.abs(first - plain.logits[0]).max()) > 1e-5 * scale, "device must not be the fp32 run"
