"""``deployment: single``: the exported vision graph composed into the language graph, one program.

QEfficient's single QPC (``kv_offload=False``) runs the vision encoder inside every prefill call
and merges with ``where(seq_len == 1, text, merged)``: a prompt in five chunks encodes its image
five times (ref: quic/efficient-transformers ``modeling_auto.py``
``_QEFFAutoModelForImageTextToTextSingleQPC`` and each family's ``kv_offload=False`` branch).
Ours encodes each image once. The two exported graphs are composed at the ONNX level::

    pixel_values ──► If(encode) ─ then: vision graph (names prefixed ``vision/``), its rows
                                        flattened to [1, n, H] and written at the front of the
                                        retained buffer: Concat(rows, Slice(vision_embeds, n:))
                              └ else: Identity(vision_embeds)
    the language graph reads the If's output wherever it read ``vision_embeds``; its
    ``vision_embeds_RetainedState`` therefore retains the encoded rows for the later chunks.

``encode`` is a function of shapes only, so a compiler folds the If per specialization and the
decode and later-chunk specializations keep no encoder: a specialization encodes when the image
side ``pixel_values`` axis 3 is larger than 1. The compiler (and the stand-in) accept positive
symbol values only, and a zero-image batch cannot switch the encoder off (the exported CLIP and
SigLIP towers refuse it at their patch Reshape), so the keep specializations bind the image
symbols to 1 and the host sends a [1, C, 1, 1] pixel placeholder (12 bytes).

The vision graph's batch symbol becomes ``num_images`` (``batch_size`` is the language batch);
its other input symbols keep their names. The composed graph is written at the export's top
level (``single.onnx``) so its weights stay in ``vision/model.onnx.data`` and
``lang/model.onnx.data``: onnx refuses external data behind a link or outside the model's
directory, so nothing large is copied.
"""

from __future__ import annotations

from pathlib import Path

from qeff_vision import symbols
from qeff_vision.errors import UserError

SINGLE_FILE = "single.onnx"
VISION_PREFIX = "vision/"
NUM_IMAGES = "num_images"
ROWS = "single/vision_rows"  # the buffer the language graph reads instead of vision_embeds
# ref: QEfficient's single QPC encodes in every specialization; ours keeps this many pixels per
# side in a keep specialization (the host's placeholder), an encode one has the image's side.
KEEP_SIDE = 1
# A vision graph whose pixel side is fixed (InternVL's 448 px tiles: its only symbol is the tile
# count, and a one-tile image has the keep placeholder's batch) gets its side axes renamed to this
# symbol in the composed graph, so the side stays the encode signal: encode entries bind the
# tile side, keep entries 1.
PIXEL_SIDE = "pixel_side"


def single_program_path(export_dir: Path) -> Path:
    """Where the composed graph of ``export_dir`` lives (whether written yet or not)."""
    return Path(export_dir) / SINGLE_FILE


def vision_symbol(name: str) -> str:
    """The composed graph's name of the vision graph's input symbol ``name``."""
    return NUM_IMAGES if name == symbols.BATCH_SIZE else name


def _load(path: Path):
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user error
        raise UserError(f"{path}: not a readable ONNX graph ({exc.__class__.__name__})") from None


def _relocate(initializer, directory: str) -> None:
    """Point an external initializer at its file seen from the export's top level."""
    for entry in initializer.external_data:
        if entry.key == "location":
            entry.value = f"{directory}/{entry.value}"


def _prefix_names(graph, keep: set[str]) -> None:
    """Prefix every value and node name of ``graph`` except the names in ``keep`` (its inputs)."""

    def renamed(name: str) -> str:
        return name if not name or name in keep else VISION_PREFIX + name

    for node in graph.node:
        node.name = VISION_PREFIX + node.name
        node.input[:] = [renamed(n) for n in node.input]
        node.output[:] = [renamed(n) for n in node.output]
        for attribute in node.attribute:
            if attribute.HasField("g") or attribute.graphs:
                raise UserError("the vision graph has control flow; deployment single cannot compose it")
    for tensor in graph.initializer:
        tensor.name = renamed(tensor.name)
    for value in graph.output:
        value.name = renamed(value.name)


def compose(vision_path: Path, language_path: Path):
    """The single-program ``ModelProto`` of an export's two graphs (external data not loaded).

    Raises:
        UserError: A graph is unreadable, or not of the form this composition handles (one
            vision output ``vision_embeds`` read by the language graph as its row buffer).
    """
    from onnx import TensorProto, helper

    vision, language = _load(vision_path), _load(language_path)
    vg, lg = vision.graph, language.graph
    embeds = symbols.VISION_EMBEDS
    lang_inputs = {value.name for value in lg.input}
    if [value.name for value in vg.output] != [embeds] or embeds not in lang_inputs:
        raise UserError(
            f"{vision_path}: deployment single composes a vision graph with the one output {embeds} "
            f"into a language graph reading it (got {[v.name for v in vg.output]})"
        )
    clash = sorted({value.name for value in vg.input} & lang_inputs)
    if clash:
        raise UserError(f"{vision_path}: vision inputs {clash} are also language inputs")
    pixel = vg.input[0]
    if len(pixel.type.tensor_type.shape.dim) != 4:
        raise UserError(f"{vision_path}: deployment single needs a [images, C, H, W] first vision input")
    # The vision graph's values, prefixed, its weights hoisted to the outer graph (a branch reads them).
    _prefix_names(vg, keep={value.name for value in vg.input})
    for tensor in vg.initializer:
        _relocate(tensor, vision_path.parent.name)
    for tensor in lg.initializer:
        _relocate(tensor, language_path.parent.name)
    at = [value.name for value in lg.input].index(embeds)
    buffer = lg.input[at].type.tensor_type
    hidden, dtype = buffer.shape.dim[2].dim_value, buffer.elem_type
    encoded = vg.output[0].name
    then_nodes = list(vg.node) + [
        helper.make_node(
            "Constant",
            [],
            ["single/rows_shape"],
            value=helper.make_tensor("single/rows_shape", TensorProto.INT64, [3], [1, -1, hidden]),
        ),
        helper.make_node("Reshape", [encoded, "single/rows_shape"], ["single/rows"]),
        # n = rows written; the rest of the retained buffer keeps its tail (Slice from n).
        helper.make_node("Shape", ["single/rows"], ["single/n"], start=1, end=2),
        helper.make_node(
            "Constant",
            [],
            ["single/axis1"],
            value=helper.make_tensor("single/axis1", TensorProto.INT64, [1], [1]),
        ),
        helper.make_node(
            "Constant",
            [],
            ["single/end"],
            value=helper.make_tensor("single/end", TensorProto.INT64, [1], [2**62]),
        ),
        helper.make_node("Slice", [embeds, "single/n", "single/end", "single/axis1"], ["single/tail"]),
        helper.make_node("Concat", ["single/rows", "single/tail"], ["single/encoded"], axis=1),
    ]
    then_branch = helper.make_graph(
        then_nodes, "encode", [], [helper.make_tensor_value_info("single/encoded", dtype, None)]
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", [embeds], ["single/kept"])],
        "keep",
        [],
        [helper.make_tensor_value_info("single/kept", dtype, None)],
    )
    gate = [
        helper.make_node("Shape", [pixel.name], ["single/side"], start=3, end=4),
        helper.make_node(
            "Constant",
            [],
            ["single/keep_side"],
            value=helper.make_tensor("single/keep_side", TensorProto.INT64, [1], [KEEP_SIDE]),
        ),
        helper.make_node("Greater", ["single/side", "single/keep_side"], ["single/encode_1"]),
        helper.make_node("Squeeze", ["single/encode_1"], ["single/encode"]),
        helper.make_node("If", ["single/encode"], [ROWS], then_branch=then_branch, else_branch=else_branch),
    ]
    for node in lg.node:
        node.input[:] = [ROWS if name == embeds else name for name in node.input]
    for value in vg.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = vision_symbol(dim.dim_param)
    for dim in pixel.type.tensor_type.shape.dim[2:]:
        if not dim.dim_param:  # a fixed side: symbolic here, bound per entry (spec/single.py)
            dim.dim_param = PIXEL_SIDE
    graph = helper.make_graph(
        gate + list(lg.node),
        "single",
        # QEfficient's order: input_ids, position_ids, pixel_values, ...; the buffer follows.
        [*lg.input[:at], *vg.input, *lg.input[at:]],
        list(lg.output),
        initializer=[*vg.initializer, *lg.initializer],
    )
    opsets = {entry.domain: entry.version for entry in vision.opset_import}
    for entry in language.opset_import:
        opsets[entry.domain] = max(entry.version, opsets.get(entry.domain, 0))
    functions = {(f.domain, f.name): f for f in (*vision.functions, *language.functions)}
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in sorted(opsets.items())],
        functions=list(functions.values()),
        producer_name="qeff-vision single",
    )
    model.ir_version = max(vision.ir_version, language.ir_version)
    return model


def write_single_program(export_dir: Path, vision_path: Path, language_path: Path) -> Path:
    """Compose the export's graphs into ``export_dir/single.onnx`` (complete or absent).

    Raises:
        UserError: The graphs cannot be composed, or the file cannot be written.
    """
    import onnx

    target = single_program_path(export_dir)
    model = compose(Path(vision_path), Path(language_path))
    staging = target.with_name(target.name + ".partial")
    try:
        onnx.save(model, str(staging))
        staging.replace(target)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise UserError(f"{target}: cannot write the single program: {exc}") from None
    return target
