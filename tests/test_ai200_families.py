"""Every family compiles for ``aic_hw_version: ai200`` through the stand-in compiler (issue 49).

Per family, its tiny checkpoint saved in bfloat16 (as releases are) is compiled from its plain
repository spec with ``compile: {aic_hw_version: ai200}``: the export stores every float weight as a
bfloat16 initializer feeding a Cast (2 bytes a parameter, at most 1.05x the checkpoint's tensor
bytes); each program's argv has ``-aic-hw-version=ai200`` and no ``-convert-to-fp16``; its custom
IO gives ``pixel_values`` and every float retained state (KV, rings, latent, recurrent,
cross-attention) ``bfloat16`` (read here from the graph, and checked again by the stand-in); the
compile runs no calibration. Each case exports and compiles (about 40 s on the shared 2-core
machine), so the default tier runs the two families whose states the others lack (recurrent:
qwen3_5; cross-attention: mllama); ``-m slow`` runs every family.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import onnx
import pytest
import torch
import yaml

from qeff_vision import symbols
from qeff_vision.checkpoint import Checkpoint
from qeff_vision.cli import main
from qeff_vision.exporter import load_adapter
from qeff_vision.families import all_families, get_family
from qeff_vision.families.base import ImageSize
from qeff_vision.spec import find_specs, load_spec
from tests import helpers
from tests.compile_fixtures import calls, stand_in
from tests.test_spec_helpers import write_spec as write_spec_data

SPECS = Path(__file__).resolve().parent.parent / "specs"
FAMILIES = [family.name for family in all_families()]
BUCKET = 32
# Bytes of the stored weights over the bf16 checkpoint's tensor bytes (issue 49's bound).
MAX_BYTES_RATIO = 1.05


def bf16_checkpoint(source: Path, target: Path) -> Path:
    """A copy of checkpoint ``source`` with every float tensor stored in bfloat16."""
    from safetensors.torch import load_file, save_file

    if not target.exists():
        shutil.copytree(source, target)
        for path in target.glob("*.safetensors"):
            tensors = {
                key: value.to(torch.bfloat16) if value.is_floating_point() else value
                for key, value in load_file(path).items()
            }
            save_file(tensors, path, metadata={"format": "pt"})
    return target


def tensor_bytes(checkpoint: Path) -> int:
    """Bytes of the tensors a safetensors checkpoint stores (headers excluded)."""
    from safetensors import safe_open

    total = 0
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                value = handle.get_slice(key)
                count = 1
                for dim in value.get_shape():
                    count *= dim
                total += count * torch.finfo(torch.bfloat16).bits // 8 if "F" in value.get_dtype() else 0
    return total


def ai200_spec(family: str, model: Path, directory: Path) -> Path:
    """The family's plain repository spec on ``model``, one bucket, for ai200."""
    base = next(
        path
        for path in find_specs(SPECS)
        if (spec := load_spec(path)).family == family
        and spec.deployment.mode == "dual"
        and spec.full_batch_size is None
        and spec.compile.comp_ctx_lengths is None
        and not spec.vision.patch_buckets
        and not any(image.video for image in spec.vision.images)
    )
    description = Checkpoint.open(model, family).description
    sizes = [ImageSize(h, w) for h, w in load_adapter(get_family(family)).test_image_sizes]
    largest = max(sizes, key=lambda size: get_family(family).image_tokens(description, size))
    rows = get_family(family).image_tokens(description, largest)
    data = yaml.safe_load(base.read_text())
    data.pop("config")
    data.update(model=str(model), ctx_len=rows + BUCKET + 1, prefill={"seq_lens": [BUCKET]})
    data["vision"]["images"] = [{"height": largest.height, "width": largest.width}]
    data["vision"].pop("max_images", None)
    data["compile"] = {"aic_hw_version": "ai200"}
    return write_spec_data(directory, data)


def _argv_values(argv: list[str], out: Path) -> dict[str, str]:
    """Flag -> value, paths in the staging directory the compiler saw moved to OUT."""
    staged = re.compile(r"/\.out\.staging\.[^/]+/")
    return {
        flag: staged.sub(f"/{out.name}/", value) for flag, _, value in (a.partition("=") for a in argv[1:])
    }


DEFAULT_TIER = ("qwen3_5", "mllama")


@pytest.mark.parametrize("family", helpers.tiered(FAMILIES, keep=DEFAULT_TIER))
def test_every_family_compiles_for_ai200_in_bfloat16(family, tiny_checkpoint, tmp_path, capsys):
    checkpoint = bf16_checkpoint(tiny_checkpoint(family), tmp_path / "bf16")
    spec = ai200_spec(family, checkpoint, tmp_path)
    compiler, record = stand_in(tmp_path)
    out = tmp_path / "out"
    code = main(["compile", str(spec), "-o", str(out), "--compiler", str(compiler)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "calibrat" not in captured.err.lower().replace("no calibration run", ""), captured.err
    assert "no calibration run" in captured.out + captured.err

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hardware"]["aic_hw_version"] == "ai200"
    # No precision plan: every program's mode is bf16, no plan file was written.
    assert {entry["node_precision"]["mode"] for entry in manifest["programs"].values()} == {"bf16"}
    assert not list(out.rglob("node_precision.yaml"))
    invocations = calls(record)
    assert len(invocations) == len(manifest["programs"]) == 2
    export = json.loads((out / "export" / "export.json").read_text())
    stored = 0
    for invocation in invocations:
        argv = invocation["argv"]
        assert "-aic-hw-version=ai200" in argv and "-convert-to-fp16" not in argv, argv
        values = _argv_values(argv, out)
        model = onnx.load(values["-m"], load_external_data=False)
        initializers = {t.name for t in model.graph.initializer}
        floats = {
            v.name
            for v in model.graph.input
            if v.name not in initializers and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        }
        retained = {o.name.removesuffix(symbols.RETAINED_SUFFIX) for o in model.graph.output}
        needed = (retained & floats) | ({symbols.PIXEL_VALUES} & floats)
        assert needed, f"{family}: no retained state or pixel input in {values['-m']}"
        custom_io = yaml.safe_load(Path(values["-custom-IO-list-file"]).read_text())
        precisions = {entry["IOName"]: entry["Precision"] for entry in custom_io}
        assert {name: precisions.get(name) for name in needed} == dict.fromkeys(needed, "bfloat16")
        assert "float16" not in precisions.values()
        # Every float weight is a bfloat16 initializer (2 bytes a parameter) read through a Cast.
        kinds = {t.data_type for t in model.graph.initializer if t.data_type in (1, 10, 16)}
        big = [
            t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims)
        ]
        assert big == [] and kinds <= {onnx.TensorProto.BFLOAT16}, (family, big[:3])
    for program in export["programs"].values():
        weights = program["weights"]
        assert weights["parameters"] and weights["bytes"] <= 2 * weights["parameters"] + 4096, weights
        stored += weights["bytes"]
    assert stored <= MAX_BYTES_RATIO * tensor_bytes(checkpoint), (stored, tensor_bytes(checkpoint))
