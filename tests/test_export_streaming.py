"""Streaming export: weights traced as placeholders, written once, page-aligned; float16 exports."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from qeff_vision.errors import UserError
from qeff_vision.export import weights
from qeff_vision.exporter import export_model, load_adapter
from qeff_vision.families import describe_checkpoint, family_for


def _lang_logits(export_dir, input_ids: np.ndarray) -> np.ndarray:
    from qeff_vision.runtime.session import OnnxProgram

    manifest = json.loads((export_dir / "export.json").read_text())
    lang = manifest["programs"]["lang"]
    program = OnnxProgram(export_dir / lang["path"])
    tokens = input_ids.shape[1]
    sizes = {"batch_size": 1, "seq_len": tokens, "vision_batch_size": 1, "vision_size": 1, "ctx_len": 16}
    feeds = {}
    for name, spec in lang["inputs"].items():
        shape = [sizes[d] if isinstance(d, str) else d for d in spec["shape"]]
        feeds[name] = np.zeros(shape, np.dtype(spec["dtype"]))
    feeds["input_ids"] = input_ids
    feeds["position_ids"] = np.broadcast_to(np.arange(tokens), feeds["position_ids"].shape).astype(np.int64)
    return program.run(feeds)["logits"].reshape(-1).astype(np.float32)


def test_weights_are_page_aligned_external_initializers_with_transposes_folded(exported):
    model = onnx.load(str(exported("qwen2_5_vl") / "lang" / "model.onnx"), load_external_data=False)
    assert [i.name for i in model.graph.input][:4] == [
        "input_ids",
        "position_ids",
        "vision_embeds",
        "image_idx",
    ]
    assert not any(i.name.startswith(("text_model.", "lm_head.", "embed_tokens.")) for i in model.graph.input)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(
        int(dict((e.key, e.value) for e in t.external_data)["offset"]) % weights.DATA_ALIGNMENT == 0
        for t in external
    )
    initializers = {t.name for t in model.graph.initializer}
    weight_transposes = [
        n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in initializers
    ]
    # Only a tied embedding (read by Gather and by the lm_head) keeps its transpose.
    assert len(weight_transposes) <= 1


def test_float16_export_matches_float32(tiny_checkpoint, exported, tmp_path):
    out = tmp_path / "fp16"
    result = export_model(tiny_checkpoint("qwen2_5_vl"), out, dtype="float16", progress=None)
    assert result.manifest["dtype"] == "float16"
    assert result.manifest["programs"]["lang"]["inputs"]["vision_embeds"]["dtype"] == "float16"
    assert {"load", "trace_vision", "trace_language", "write_vision", "write_lang", "check"} <= set(
        result.timings
    )
    ids = np.array([[3, 17, 5, 42, 9, 11]], dtype=np.int64)
    full, half = _lang_logits(exported("qwen2_5_vl"), ids), _lang_logits(out, ids)
    assert np.abs(full - half).max() <= 1e-2 * (full.max() - full.min())


def test_placeholder_model_holds_no_weight_storage(tiny_checkpoint):
    model_dir = tiny_checkpoint("gemma3")
    adapter = load_adapter(family_for(describe_checkpoint(model_dir)))
    model = adapter.empty_model(model_dir, torch.float32)
    plan = weights.build_without_weights(model_dir, model, torch.float32)
    params = list(model.parameters())
    assert params and all(p.untyped_storage().nbytes() <= 8 for p in params)
    reference = dict(adapter.load(model_dir).named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(plan.read(param), reference[name]), name


def test_unknown_export_dtype_is_a_user_error(tiny_checkpoint, tmp_path):
    with pytest.raises(UserError, match="dtype"):
        export_model(tiny_checkpoint("qwen2_5_vl"), tmp_path / "x", dtype="bfloat16", progress=None)
    assert not (tmp_path / "x").exists()


class _Mixed(torch.nn.Module):
    """Two linears with placeholder weights around a product with a real (non-placeholder) buffer."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.first, self.last = torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)
        self.register_buffer("real", torch.randn(64, 96, dtype=dtype))
        for layer in (self.first, self.last):
            for name, param in list(layer._parameters.items()):
                if param is not None:
                    zero = torch.zeros((), dtype=dtype).expand(param.shape)
                    layer._parameters[name] = torch.nn.Parameter(zero, requires_grad=False)

    def forward(self, x):
        return self.last(torch.nn.functional.silu(self.first(x)) + x @ self.real), x @ self.real


def test_placeholder_linears_run_dense_without_changing_the_graph(tmp_path):
    module = _Mixed(torch.float16)
    x = torch.randn(1, 5, 64, dtype=torch.float16)
    with torch.no_grad():
        expected = module(x)
        with weights.dense_placeholder_linears(module):
            got = module(x)
    assert "forward" not in vars(module)  # the wrapper is removed afterwards
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # same values: zeros are zeros
    graphs = []
    for skipped in (False, True):
        path = tmp_path / f"skipped-{skipped}.onnx"
        with weights.dense_placeholder_linears(module) if skipped else torch.no_grad(), torch.no_grad():
            torch.onnx.export(
                module,
                (x,),
                str(path),
                input_names=["x"],
                dynamo=False,
                export_params=False,
                keep_initializers_as_inputs=True,
            )
        graph = onnx.load(str(path)).graph
        graphs.append(
            ([(n.op_type, list(n.input), list(n.output)) for n in graph.node], [i.name for i in graph.input])
        )
    assert graphs[0] == graphs[1]  # the linears still read the weight inputs; no constant added
    assert [op for op, _, _ in graphs[1][0]].count("MatMul") == 3
    assert len(graphs[1][1]) == 5 and "Constant" not in [op for op, _, _ in graphs[1][0]]  # x, real, 3 params


def test_persistent_buffers_trace_as_constants_not_inputs(tmp_path):
    """A persistent buffer (a router's correction bias) is a constant of the graph, not an input nothing
    feeds; the module's state dict is unchanged afterwards."""
    from torch import nn

    from qeff_vision.export.weights import buffers_as_constants

    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("correction_bias", torch.arange(4.0))

        def forward(self, x):
            return self.proj(x) + self.correction_bias

    module = Routed().eval()
    path = tmp_path / "routed.onnx"
    with buffers_as_constants(module), torch.no_grad():
        torch.onnx.export(
            module,
            (torch.ones(1, 4),),
            str(path),
            dynamo=False,
            input_names=["x"],
            export_params=False,
            keep_initializers_as_inputs=True,
        )
    names = [value.name for value in onnx.load(path).graph.input]
    assert "correction_bias" not in names and "proj.weight" in names, names
    assert "correction_bias" in module.state_dict()
