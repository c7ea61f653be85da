"""On-device sampler (issue 40): the math on many random rows, the buffers' rules, the spec option.

* The exported sampler head (onnxruntime, the graph the family programs carry) and the host's
  :func:`~qeff_vision.runtime.device_sampler.gumbel_max_tokens` pick the same token for the same
  logits, buffers, parameters and random numbers: hundreds of rows with every step in use
  (penalties, temperature, top-k at, under and above ``max_top_k_ids``, top-p, min-p, greedy
  rows, guided decoding).
* Penalty buffers: padding and idle rows (``batch_index`` -1) mark nothing, a prompt starting at
  position 0 clears its slot only, a decode step marks the fed token in both buffers.
* ``compile.language.sampler``: checked keys, refused with the reason for ``deployment: single``
  and a ``max_top_k_ids`` above the vocabulary; specializations and ``custom_io.yaml`` carry the
  new IO with QEfficient's precisions.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml

from qeff_vision.cli import main
from qeff_vision.contract.sampler_io import (
    MIN_PS,
    PRESENCE_BUFFER,
    PRESENCE_PENALTIES,
    RANDOM_NUMBERS,
    REPETITION_BUFFER,
    REPETITION_PENALTIES,
    TEMPERATURES,
    TOP_KS,
    TOP_PS,
    SamplerOptions,
)
from qeff_vision.export.sampler import sample, update_buffers
from qeff_vision.runtime.device_sampler import UNIFORM_HIGH, UNIFORM_LOW
from qeff_vision.spec import build_specializations, load_spec
from tests.gumbel_max import gumbel_max_tokens
from tests.test_continuous_batching import SPECS
from tests.test_spec_helpers import problems_of

PARAMETERS = (REPETITION_PENALTIES, PRESENCE_PENALTIES, TEMPERATURES, TOP_KS, TOP_PS, MIN_PS)


class _Head(torch.nn.Module):
    """The sampler alone: what :class:`~qeff_vision.export.sampler.SamplerDecoder` runs on the logits."""

    def __init__(self, options: SamplerOptions):
        super().__init__()
        self.options = options

    def forward(self, logits, repetition, presence, bitmask, random_numbers, *params):
        named = dict(zip(PARAMETERS, params))
        tokens, _ = sample(logits, repetition, presence, named, random_numbers, self.options, bitmask)
        return tokens


def _random_rows(rng, rows: int, vocab: int, k: int) -> dict[str, np.ndarray]:
    temperatures = rng.choice([0.0, 0.5, 1.0, 1.7], size=(rows, 1))
    return {
        "logits": (rng.standard_normal((rows, vocab)) * rng.choice([1.0, 4.0], size=(rows, 1))).astype(
            np.float32
        ),
        REPETITION_BUFFER: rng.random((rows, vocab)) < 0.2,
        PRESENCE_BUFFER: rng.random((rows, vocab)) < 0.1,
        "bitmask": rng.random((rows, vocab)) < 0.9,
        RANDOM_NUMBERS: np.clip(rng.random((rows, k), dtype=np.float32), UNIFORM_LOW, UNIFORM_HIGH),
        REPETITION_PENALTIES: rng.choice([1.0, 0.7, 1.5], size=(rows, 1)).astype(np.float32),
        PRESENCE_PENALTIES: rng.choice([0.0, 0.6, -0.4], size=(rows, 1)).astype(np.float32),
        TEMPERATURES: temperatures.astype(np.float32),
        TOP_KS: rng.choice([1, 3, k // 2, k, 4 * k], size=(rows, 1)).astype(np.int32),
        TOP_PS: rng.choice([1.0, 0.9, 0.5], size=(rows, 1)).astype(np.float32),
        MIN_PS: rng.choice([0.0, 0.05, 0.3], size=(rows, 1)).astype(np.float32),
    }


def test_exported_sampler_head_and_host_math_pick_the_same_tokens(tmp_path):
    options = SamplerOptions(max_top_k_ids=24)
    rng = np.random.default_rng(0)
    rows, vocab = 400, 97
    data = _random_rows(rng, rows, vocab, options.max_top_k_ids)
    names = ["logits", REPETITION_BUFFER, PRESENCE_BUFFER, "bitmask", RANDOM_NUMBERS, *PARAMETERS]
    example = tuple(torch.from_numpy(data[name][:2]) for name in names)
    path = tmp_path / "head.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            _Head(options),
            example,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=names,
            output_names=["next_tokens"],
            dynamic_axes={name: {0: "rows"} for name in names},
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    device = session.run(None, {name: data[name] for name in names})[0][:, 0]
    host = gumbel_max_tokens(
        data["logits"],
        data[REPETITION_BUFFER],
        data[PRESENCE_BUFFER],
        data,
        options.max_top_k_ids,
        data["bitmask"],
    )
    np.testing.assert_array_equal(device, host)
    sampled = data[TEMPERATURES][:, 0] != 0
    # The rows drew: sampled tokens are often not the argmax, and greedy rows always are.
    assert (host[sampled] != data["logits"][sampled].argmax(axis=1)).mean() > 0.3


def _buffers(slots=3, vocab=11):
    return torch.zeros(slots, vocab, dtype=torch.bool), torch.zeros(slots, vocab, dtype=torch.bool)


def test_penalty_buffers_follow_the_calls_rows_and_nothing_else():
    repetition, presence = _buffers()
    repetition[1, 9] = presence[1, 9] = True  # a previous occupant of slot 1
    repetition[2, 4] = presence[2, 4] = True  # a request running in slot 2
    # Prefill of a new prompt in slot 1: two valid tokens, then padding (position -1, token 0).
    ids = torch.tensor([[3, 5, 0, 0]])
    positions = torch.tensor([[0, 1, -1, -1]])
    repetition, presence = update_buffers(ids, positions, ids, torch.tensor([[1]]), repetition, presence)
    assert repetition[1].nonzero().view(-1).tolist() == [3, 5] and not presence[1].any()
    assert repetition[2].nonzero().view(-1).tolist() == [4] and presence[2].nonzero().view(-1).tolist() == [4]
    # The prompt's next chunk adds to slot 1 (it does not start at 0).
    ids = torch.tensor([[7, 0, 0, 0]])
    positions = torch.tensor([[2, -1, -1, -1]])
    repetition, presence = update_buffers(ids, positions, ids, torch.tensor([[1]]), repetition, presence)
    assert repetition[1].nonzero().view(-1).tolist() == [3, 5, 7]
    # Decode at batch 3: slot 1 fed token 8, slot 2 fed token 6, an idle row at batch_index -1.
    ids = torch.tensor([[8], [6], [-1]])
    positions = torch.tensor([[3], [9], [-1]])
    slot = torch.remainder(torch.tensor([[1], [2], [-1]]), 3)
    repetition, presence = update_buffers(ids, positions, ids, slot, repetition, presence)
    assert repetition[1].nonzero().view(-1).tolist() == [3, 5, 7, 8] and presence[1].nonzero().view(
        -1
    ).tolist() == [8]
    assert presence[2].nonzero().view(-1).tolist() == [4, 6]
    assert not repetition[0].any() and not presence[0].any()


# ---- spec option ----


def _with_sampler(tmp_path, spec: str, sampler, **top):
    data = yaml.safe_load((SPECS / spec).read_text())
    data.setdefault("compile", {}).setdefault("language", {})["sampler"] = sampler
    data["config"] = str(((SPECS / spec).parent / data["config"]).resolve())
    data.update(top)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_sampler_option_is_read_with_defaults(tmp_path):
    spec = load_spec(_with_sampler(tmp_path, "llava/llava-1.5-7b-hf-cb.yaml", {"max_top_k_ids": 256}))
    assert spec.compile.language.sampler == SamplerOptions(max_top_k_ids=256)
    assert spec.compile.vision.sampler is None


@pytest.mark.parametrize(
    ("sampler", "problem"),
    [
        ({"max_top_k_ids": 0}, "compile.language.sampler: max_top_k_ids: must be a positive integer (got 0)"),
        (
            {"top_k": 5},
            "compile.language.sampler: top_k: unknown key; allowed: max_top_k_ids, return_pdfs, "
            "guided_decoding",
        ),
        ({"return_pdfs": "yes"}, "compile.language.sampler: return_pdfs: must be true or false (got 'yes')"),
        (
            True,
            "compile.language.sampler: must be a mapping with max_top_k_ids, return_pdfs, "
            "guided_decoding (each optional)",
        ),
        ({"max_top_k_ids": 10**7}, "compile.language.sampler.max_top_k_ids: 10000000 exceeds the vocabulary"),
    ],
)
def test_a_bad_sampler_option_is_one_problem(tmp_path, sampler, problem):
    problems = problems_of(_with_sampler(tmp_path, "llava/llava-1.5-7b-hf-cb.yaml", sampler))
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_the_sampler_in_a_single_program_is_refused_with_the_reason(tmp_path, capsys):
    path = _with_sampler(tmp_path, "llava/llava-1.5-7b-hf.yaml", {}, deployment="single")
    (problem,) = problems_of(path)
    assert problem.startswith("compile.language.sampler: deployment single composes the vision encoder")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_vision_program_takes_no_sampler(tmp_path):
    data = yaml.safe_load((SPECS / "llava/llava-1.5-7b-hf.yaml").read_text())
    data["config"] = str((SPECS / "llava" / data["config"]).resolve())
    data.setdefault("compile", {})["vision"] = {"sampler": {}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert problems_of(path) == ["compile.vision.sampler: applies to the language program only"]


@pytest.mark.parametrize("kv", ["float16", "mxint8"])
def test_specializations_and_custom_io_carry_the_sampler(tmp_path, kv):
    """Symbols unchanged (the sampler adds no axis); the buffers' custom IO is QEfficient's KV dtype."""
    spec_name = "llava/llava-1.5-7b-hf-cb.yaml"
    (tmp_path / "plain").mkdir()
    (tmp_path / "sampled").mkdir()
    plain = _with_sampler(tmp_path / "plain", spec_name, None, compile={"language": {"kv_cache_dtype": kv}})
    path = _with_sampler(
        tmp_path / "sampled", spec_name, None, compile={"language": {"kv_cache_dtype": kv, "sampler": {}}}
    )
    plain, sampled = build_specializations(load_spec(plain)), build_specializations(load_spec(path))
    assert [s.symbols for s in sampled.language.specializations] == [
        s.symbols for s in plain.language.specializations
    ]
    extra = [entry for entry in sampled.language.custom_io if entry not in plain.language.custom_io]
    assert extra == [
        ("past_repetition_penalty_buffer", kv),
        ("past_presence_penalty_buffer", kv),
        ("past_repetition_penalty_buffer_RetainedState", kv),
        ("past_presence_penalty_buffer_RetainedState", kv),
    ]


def test_export_cli_compiles_the_sampler_in_by_hand(tiny_checkpoint, tmp_path, capsys):
    """``export --sampler-top-k K``: the manifest records it, as the compile's staleness check reads it."""
    from qeff_vision.export_record import read_export

    out = tmp_path / "export"
    code = main(["export", str(tiny_checkpoint("llava")), "-o", str(out), "--sampler-top-k", "16", "-q"])
    assert code == 0, capsys.readouterr().err
    assert read_export(out)["sampler"] == SamplerOptions(max_top_k_ids=16).to_dict()
    assert "random_numbers" in read_export(out)["programs"]["lang"]["inputs"]


def test_export_cli_takes_every_sampler_key_as_the_spec_names_it(tiny_checkpoint, tmp_path, capsys):
    """``--sampler KEY=VALUE``: return_pdfs adds ``probs``, guided_decoding ``token_bitmasks``."""
    from qeff_vision.export_record import read_export

    out = tmp_path / "export"
    keys = ["max_top_k_ids=16", "return_pdfs=true", "guided_decoding=true"]
    argv = ["export", str(tiny_checkpoint("llava")), "-o", str(out), "-q"]
    code = main([*argv, *(arg for key in keys for arg in ("--sampler", key))])
    assert code == 0, capsys.readouterr().err
    record = read_export(out)
    assert record["sampler"] == SamplerOptions(16, return_pdfs=True, guided_decoding=True).to_dict()
    assert "token_bitmasks" in record["programs"]["lang"]["inputs"]
    assert "probs" in record["programs"]["lang"]["outputs"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sampler", "return_pdfs=maybe"], "--sampler: return_pdfs: must be true or false (got 'maybe')"),
        (["--sampler", "guided_decoding=1"], "--sampler: guided_decoding: must be true or false (got 1)"),
        (["--sampler", "max_top_k_ids=0"], "--sampler: max_top_k_ids: must be a positive integer (got 0)"),
        (
            ["--sampler", "top_k=5"],
            "--sampler: top_k: unknown key; allowed: max_top_k_ids, return_pdfs, guided",
        ),
        (["--sampler", "return_pdfs"], "--sampler return_pdfs: expected KEY=VALUE"),
        (
            ["--sampler", "return_pdfs=true", "--sampler", "return_pdfs=false"],
            "--sampler return_pdfs: given twice",
        ),
        (
            ["--sampler-top-k", "8", "--sampler", "max_top_k_ids=16"],
            "--sampler-top-k and --sampler max_top_k_ids",
        ),
    ],
)
def test_export_cli_refuses_a_bad_sampler_key_in_one_line(tiny_checkpoint, tmp_path, capsys, args, message):
    out = tmp_path / "export"
    code = main(["export", str(tiny_checkpoint("llava")), "-o", str(out), "-q", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"qeff-vision: error: {message}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()  # refused before anything is written


def test_a_stale_export_is_refused_with_the_flags_the_spec_needs(tiny_checkpoint, tmp_path, capsys):
    """A spec's sampler and its export's differ: the message names the ``export`` flags to use."""
    export = tmp_path / "export"
    checkpoint = str(tiny_checkpoint("llava"))
    assert main(["export", checkpoint, "-o", str(export), "-q", "--sampler", "max_top_k_ids=16"]) == 0
    data = yaml.safe_load((SPECS / "llava/llava-1.5-7b-hf.yaml").read_text())
    data.pop("config")
    data.update(model=checkpoint, ctx_len=256, prefill={"seq_lens": [32]})
    data["compile"] = {"language": {"sampler": {"max_top_k_ids": 16, "return_pdfs": True}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    args = [
        "compile",
        str(path),
        "-o",
        str(tmp_path / "out"),
        "--backend",
        "onnxruntime",
        "--export",
        str(export),
    ]
    assert main(args) == 2
    flags = "--sampler max_top_k_ids=16 --sampler return_pdfs=true --sampler guided_decoding=false"
    assert f"(`qeff-vision export {flags}`)" in capsys.readouterr().err


def test_validate_warns_that_the_plugin_cannot_serve_a_sampler_program(tmp_path):
    from qeff_vision import api

    problems, warnings = api.validate(_with_sampler(tmp_path, "llava/llava-1.5-7b-hf-cb.yaml", {}))
    assert problems == []
    assert warnings[0].startswith("vLLM 0.23.0 + vllm-qaic: the plugin never feeds the on-device sampler's")


# (sampler spec, its plain sibling, the language programs) of the golden sampler specs.
GOLDEN_SAMPLER_SPECS = [
    ("qwen2_5_vl-3b-instruct-cb-sampler", "qwen2_5_vl-3b-instruct-cb", ["lang"]),
    ("gemma-3-4b-it-disaggregated-sampler", "gemma-3-4b-it-disaggregated", ["lang_prefill", "lang_decode"]),
]


@pytest.mark.parametrize(("name", "plain", "programs"), GOLDEN_SAMPLER_SPECS)
def test_golden_sampler_specs_carry_the_buffers_as_qefficients_compile(name, plain, programs):
    """A dual CB and a disaggregated golden: the specializations of the plain spec, and custom IO
    adding exactly the two buffers and their retained outputs at the KV's precision (QEfficient's
    dual compile gives every ``_RetainedState`` output and its input ``kv_cache_dtype``)."""
    golden = SPECS / "golden"
    for program in programs:
        assert (golden / name / program / "specializations.json").read_text() == (
            golden / plain / program / "specializations.json"
        ).read_text()
        sampled = yaml.safe_load((golden / name / program / "custom_io.yaml").read_text())
        base = yaml.safe_load((golden / plain / program / "custom_io.yaml").read_text())
        extra = {entry["IOName"]: entry["Precision"] for entry in sampled if entry not in base}
        (kv,) = {entry["Precision"] for entry in base if entry["IOName"].startswith("past_key.")}
        assert extra == {
            f"past_{kind}_penalty_buffer{suffix}": kv
            for kind in ("repetition", "presence")
            for suffix in ("", "_RetainedState")
        }
