"""Choosing how weights are stored: the spec's ``weights`` key, export's flags, compile's export.

``weights.dtype: auto`` stores a program's weights in float16 when it is compiled to fp16 (the
ai100 default, ``-convert-to-fp16``) and float32 otherwise; ``qeff-vision export`` writes float32
unless told. A compile's own export follows the spec, and an OUT/export of another form is stale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qeff_vision.cli import main
from qeff_vision.errors import SpecError
from qeff_vision.export_record import read_export
from qeff_vision.spec import load_spec

SPECS = Path(__file__).resolve().parents[1] / "specs"


def _spec(tmp_path, checkpoint, **top) -> Path:
    data = yaml.safe_load((SPECS / "llava/llava-1.5-7b-hf.yaml").read_text())
    data.pop("config")
    data.update(model=str(checkpoint), ctx_len=256, prefill={"seq_lens": [32]}, **top)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        ({}, {"vision": "float16", "lang": "float16"}),  # ai100's default: -convert-to-fp16
        ({"compile": {"convert_to_fp16": False}}, {"vision": "float32", "lang": "float32"}),
        (
            {"compile": {"language": {"convert_to_fp16": False}}},
            {"vision": "float16", "lang": "float32"},
        ),
        ({"weights": {"dtype": "float32"}}, {"vision": "float32", "lang": "float32"}),
        (
            {"dtype": "float16", "compile": {"convert_to_fp16": False}},
            {"vision": "float16", "lang": "float16"},
        ),
    ],
)
def test_auto_stores_float16_where_the_program_is_compiled_to_fp16(tiny_checkpoint, tmp_path, top, expected):
    spec = load_spec(_spec(tmp_path, tiny_checkpoint("llava"), **top))
    assert spec.weight_dtypes() == expected
    assert not spec.weights.keep_quantized


def test_bad_weights_keys_are_listed_together(tiny_checkpoint, tmp_path):
    weights = {"dtype": "bf16", "keep_quantized": "yes", "scheme": "int4"}
    with pytest.raises(SpecError) as raised:
        load_spec(_spec(tmp_path, tiny_checkpoint("llava"), weights=weights))
    problems = raised.value.problems
    assert "weights.scheme: unknown key; allowed: dtype, keep_quantized" in problems
    assert "weights.dtype: must be one of auto, float32, float16, bfloat16 (got 'bf16')" in problems
    assert "weights.keep_quantized: must be true or false (got 'yes')" in problems


def test_export_flags_choose_the_form_and_a_bad_one_is_one_line(tiny_checkpoint, tmp_path, capsys):
    checkpoint = str(tiny_checkpoint("llava"))
    out = tmp_path / "export"
    assert (
        main(["export", checkpoint, "-o", str(out), "-q", "--weight-dtype", "float16", "--keep-quantized"])
        == 0
    )
    record = read_export(out)
    assert record["weights"]["lang"] == {"dtype": "float16", "keep_quantized": True}
    assert record["opset"] == 21  # kept quantized: DequantizeLinear-21 (none here: a float checkpoint)
    plain = tmp_path / "plain"
    assert main(["export", checkpoint, "-o", str(plain), "-q"]) == 0
    assert read_export(plain)["weights"]["vision"] == {"dtype": "float32", "keep_quantized": False}
    bad = tmp_path / "bad"
    assert main(["export", checkpoint, "-o", str(bad), "-q", "--weight-dtype", "int4"]) == 2
    err = capsys.readouterr().err
    assert "--weight-dtype" in err and "Traceback" not in err and not bad.exists()


def test_compile_exports_in_the_spec_form_and_re_exports_when_it_changes(tiny_checkpoint, tmp_path, capsys):
    checkpoint = tiny_checkpoint("llava")
    out = tmp_path / "out"
    args = ["compile", "-o", str(out), "--backend", "onnxruntime"]
    spec = _spec(tmp_path, checkpoint)
    assert main([*args[:1], str(spec), *args[1:]]) == 0, capsys.readouterr().err
    first = read_export(out / "export")
    assert first["weights"]["lang"]["dtype"] == "float16"  # auto on an fp16 compile
    # A float32 tiny checkpoint: fp16 would change its values, so every weight stays float32.
    kept = first["programs"]["lang"]["weights"]["kept_float32"]
    assert kept and all(entry["extra_bits"] for entry in kept)
    spec = _spec(tmp_path, checkpoint, weights={"dtype": "float32"})
    capsys.readouterr()
    assert main([*args[:1], str(spec), *args[1:]]) == 0
    assert "the previous export is stale" in capsys.readouterr().err
    assert read_export(out / "export")["weights"]["lang"]["dtype"] == "float32"
