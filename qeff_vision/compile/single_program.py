"""``deployment: single``: the exported vision graph composed into the language graph, one program.

QEfficient's single QPC (``kv_offload=False``) runs the vision encoder inside every prefill call
and merges with ``where(seq_len == 1, text, merged)``: a prompt in five chunks encodes its image
five times (ref: quic/efficient-transformers ``modeling_auto.py``
``_QEFFAutoModelForImageTextToTextSingleQPC`` and each family's ``kv_offload=False`` branch).
Ours encodes each image once. The two exported graphs are composed at the ONNX level::

    pixel_values ──► If(encode) ─ then: vision graph (names prefixed ``vision/``), its rows
                                        flattened to [1, n, H] and written into the retained
                                        buffer from row ``image_idx`` (0 in a first chunk; a
                                        prompt's later same-size group its first row), the
                                        rows before and after kept (a row select:
                                        Where(row in [f, f+n), Gather(rows), buffer))
                              └ else: Identity(vision_embeds)
    the language graph reads the If's output wherever it read ``vision_embeds``; its
    ``vision_embeds_RetainedState`` therefore retains the encoded rows for the later chunks.

``encode`` is a function of shapes only, so a compiler folds the If per specialization and the
decode and later-chunk specializations keep no encoder: a specialization encodes when the pixel
input's gate axis (the family's ``single_encode_axis``: the image side, the last axis of
[..., C, H, W] images, or the patch axis of a patch sequence such as Qwen-VL's
[patches, patch_dim]) is larger than 1.

The cross-attention kind (mllama) composes the same way: its vision outputs are the cross
layers' K/V, named like the language graph's cache inputs of those layers, so the encode branch
writes the images' K/V into those retained caches (as QEfficient's single QPC retains them) and
every later chunk and decode step reads them with no encoder. A later turn's images go after the
ones an earlier turn wrote, which its tokens may still attend to: the composed graph takes
``first_image_slot`` ([1] int64) and writes from that slot, keeping the slots before it.

The compiler (and the stand-in) accept positive symbol values only, and a zero-image batch
cannot switch the encoder off (the exported CLIP and SigLIP towers refuse it at their patch
Reshape), so the keep specializations bind the image symbols to 1 and the host sends a
placeholder with every symbolic axis 1 ([1, C, 1, 1] pixels, 12 bytes; mllama's int64
aspect-ratio inputs in their own dtype).

The vision graph's image-count symbol (the family's ``vision_images_symbol``: LLaVA's batch
axis, mllama's ``max_num_images``) becomes ``num_images``; its other input symbols keep their
names (mllama's ``batch_size`` is the language batch). The composed graph is written at the export's top
level (``single.onnx``) so its weights stay in ``vision/model.onnx.data`` and
``lang/model.onnx.data``: onnx refuses external data behind a link or outside the model's
directory, so nothing large is copied.
"""

from __future__ import annotations

from pathlib import Path

from qeff_vision import symbols
from qeff_vision.contract.deployment_programs import KEEP_SIDE
from qeff_vision.errors import UserError
from qeff_vision.symbols import NUM_IMAGES, PIXEL_SIDE

SINGLE_FILE = "single.onnx"
VISION_PREFIX = "vision/"
ROWS = "single/vision_rows"  # the buffer the language graph reads instead of vision_embeds
# A vision graph whose pixel side is fixed (InternVL's 448 px tiles: its only symbol is the tile
# count, and a one-tile image has the keep placeholder's batch) gets its side axes renamed to
# PIXEL_SIDE in the composed graph, so the side stays the encode signal: encode entries bind the
# tile side, keep entries KEEP_SIDE.


def single_program_path(export_dir: Path) -> Path:
    """Where the composed graph of ``export_dir`` lives (whether written yet or not)."""
    return Path(export_dir) / SINGLE_FILE


def vision_symbol(name: str, images_symbol: str = symbols.BATCH_SIZE) -> str:
    """The composed graph's name of the vision graph's input symbol ``name``.

    ``images_symbol`` is the vision graph's symbol counting the images of one call (the family's
    ``vision_images_symbol``); it becomes ``num_images``, every other symbol keeps its name.
    """
    return NUM_IMAGES if name == images_symbol else name


def _load(path: Path):
    from qeff_vision.graph_file import load_graph

    try:
        # Node attributes come into memory (older exports stored large constants externally):
        # the composed graph's only external tensors are the two graphs' initializers.
        return load_graph(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user error
        raise UserError(f"{path}: not a readable ONNX graph ({exc.__class__.__name__})") from None


def _relocate_graph(graph, directory: str) -> None:
    """Point every external initializer of ``graph`` at its file seen from the export's top level."""
    for tensor in graph.initializer:
        for entry in tensor.external_data:
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


# The batch axis of a retained buffer (1 in the composed program's batch-1 entries).
BATCH_AXES = (symbols.VISION_BATCH_SIZE, symbols.BATCH_SIZE)


def _row_axis(value) -> int:
    """The row axis of a retained buffer input: ``vision_size``, else its first symbolic axis after the batch.

    ``vision_embeds`` [vision_batch_size, vision_size, hidden] -> 1; stacked rows (Qwen3-VL's
    ``deepstack_features`` [num_feature_layers, vision_batch_size, vision_size, hidden]) -> 2; a
    cross-attention K/V [batch_size, kv_heads, cross_states, head_dim] -> 2.
    """
    dims = value.type.tensor_type.shape.dim
    names = [dim.dim_param for dim in dims]
    if symbols.VISION_SIZE in names:
        return names.index(symbols.VISION_SIZE)
    for axis in range(1, len(dims)):
        if dims[axis].dim_param:
            return axis
    raise UserError(f"{value.name}: a retained buffer needs a symbolic row axis")


def _buffer_shape(buffer, axis: int) -> list[int]:
    """The Reshape target of a vision output written into ``buffer``: batch 1, rows -1.

    Fixed axes keep their extent; another symbolic axis before the rows (a stacked depth) is 0,
    Reshape's "copy the vision output's extent", which has that axis at the same place.
    """
    dims = buffer.type.tensor_type.shape.dim
    names = [dim.dim_param for dim in dims]
    # The batch axis: the first named so, else axis 0 (the original layout's assumption).
    batch = next((i for i, name in enumerate(names) if name in BATCH_AXES), 0)
    shape = []
    for index, dim in enumerate(dims):
        if index == axis:
            shape.append(-1)
        elif index == batch:
            shape.append(1)
        else:
            shape.append(0 if dim.dim_param else dim.dim_value)
    return shape


def _constant(helper, TensorProto, name: str, values: list[int]):
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values)
    )


def _write_rows(
    helper,
    TensorProto,
    buffer,
    encoded: str,
    slot: tuple[str, int] | None = None,
    cursor: str | None = None,
) -> tuple[list, str]:
    """Nodes writing the vision output ``encoded`` into ``buffer``, from its front or an image slot.

    The output is reshaped to the buffer's layout (batch 1, the row axis -1, fixed axes kept), so
    its n rows land at rows f..f+n-1; the rows before f are kept (the images an earlier turn
    wrote) and the rows after are zeroed (no stale image of an earlier conversation stays). f is 0,
    or with ``slot`` (the pixel input and its image-count axis) ``first_image_slot`` times the
    rows per image (n over the encoded image count).

    With ``cursor`` (the token-merge kind's ``image_idx`` [1, 1]) f is its value and the rows
    after are kept too: a prompt whose images need several
    encode calls (images of different sizes where one call takes one size: Mistral 3; LLaVA-NeXT,
    whose output is padded to its tile count's most rows, one call per image) writes each group at
    its first row (runtime/single.py orders the calls). A first chunk's ``image_idx`` is 0, so a
    one-call prompt writes at the front as before; rows past the prompt's images are never read
    (placeholders read rows by ``image_idx``). Every write is a static row select
    (:func:`_select_rows`): no shape follows f.
    """
    name = buffer.name
    axis = _row_axis(buffer)
    shape = _buffer_shape(buffer, axis)
    if any(value == 0 for value in shape[axis + 1 :]):
        raise UserError(f"{name}: deployment single needs fixed axes besides the batch and the rows")
    tag = f"single/{name}"
    nodes = [
        _constant(helper, TensorProto, f"{tag}/shape", shape),
        helper.make_node("Reshape", [encoded, f"{tag}/shape"], [f"{tag}/rows"]),
        helper.make_node("Shape", [f"{tag}/rows"], [f"{tag}/n"], start=axis, end=axis + 1),
    ]
    first_row = f"{tag}/first"
    if cursor is not None:
        nodes += [
            _constant(helper, TensorProto, f"{tag}/one_row", [1]),
            helper.make_node("Reshape", [cursor, f"{tag}/one_row"], [first_row]),
        ]
    elif slot is None:
        nodes.append(_constant(helper, TensorProto, first_row, [0]))
    else:
        pixel, image_axis = slot
        nodes += [
            helper.make_node("Shape", [pixel], [f"{tag}/images"], start=image_axis, end=image_axis + 1),
            helper.make_node("Div", [f"{tag}/n", f"{tag}/images"], [f"{tag}/per_image"]),
            helper.make_node("Mul", [symbols.FIRST_IMAGE_SLOT, f"{tag}/per_image"], [first_row]),
        ]
    return _select_rows(helper, TensorProto, buffer, axis, nodes, tag, clear_after=cursor is None)


def _select_rows(helper, TensorProto, buffer, axis: int, nodes: list, tag: str, clear_after: bool):
    """The write of :func:`_write_rows` with every shape static: a row select, not a concat.

    Buffer row r takes encoded row r - f where 0 <= r - f < n (f the value of ``{tag}/first``, n
    the encoded rows); a row before f keeps its value, a row after the encoded ones keeps it too
    or, with ``clear_after``, becomes zero. Only values depend on f (an input's value: the cursor
    or ``first_image_slot``), so a compiler fixes every shape per specialization; encoded rows past
    the buffer's end are dropped (a vision output padded to a fixed length, LLaVA-NeXT's, may be
    longer than the rows left).
    """
    rank = len(buffer.type.tensor_type.shape.dim)
    rows = f"{tag}/rows"
    mask_shape = [1] * rank
    mask_shape[axis] = -1
    nodes += [
        _constant(helper, TensorProto, f"{tag}/zero", [0]),
        _constant(helper, TensorProto, f"{tag}/one", [1]),
        _constant(helper, TensorProto, f"{tag}/mask_shape", mask_shape),
        helper.make_node("Shape", [buffer.name], [f"{tag}/total"], start=axis, end=axis + 1),
        helper.make_node("Squeeze", [f"{tag}/total", f"{tag}/zero"], [f"{tag}/total_0d"]),
        helper.make_node("Squeeze", [f"{tag}/zero", f"{tag}/zero"], [f"{tag}/zero_0d"]),
        helper.make_node("Squeeze", [f"{tag}/one", f"{tag}/zero"], [f"{tag}/one_0d"]),
        helper.make_node("Range", [f"{tag}/zero_0d", f"{tag}/total_0d", f"{tag}/one_0d"], [f"{tag}/r"]),
        helper.make_node("Sub", [f"{tag}/r", f"{tag}/first"], [f"{tag}/source"]),
        helper.make_node("GreaterOrEqual", [f"{tag}/source", f"{tag}/zero"], [f"{tag}/after_first"]),
        helper.make_node("Less", [f"{tag}/source", f"{tag}/n"], [f"{tag}/before_end"]),
        helper.make_node("And", [f"{tag}/after_first", f"{tag}/before_end"], [f"{tag}/written"]),
        helper.make_node("Sub", [f"{tag}/n", f"{tag}/one"], [f"{tag}/last"]),
        helper.make_node("Max", [f"{tag}/source", f"{tag}/zero"], [f"{tag}/low"]),
        helper.make_node("Min", [f"{tag}/low", f"{tag}/last"], [f"{tag}/index"]),
        helper.make_node("Gather", [rows, f"{tag}/index"], [f"{tag}/moved"], axis=axis),
        helper.make_node("Reshape", [f"{tag}/written", f"{tag}/mask_shape"], [f"{tag}/mask"]),
    ]
    kept = buffer.name
    if clear_after:  # rows past the encoded ones: no stale image of an earlier conversation stays
        kept = f"{tag}/cleared"
        nodes += [
            helper.make_node("Less", [f"{tag}/source", f"{tag}/zero"], [f"{tag}/before_first"]),
            helper.make_node("Reshape", [f"{tag}/before_first", f"{tag}/mask_shape"], [f"{tag}/head_mask"]),
            helper.make_node("Shape", [buffer.name], [f"{tag}/buffer_shape"]),
            helper.make_node(
                "ConstantOfShape",
                [f"{tag}/buffer_shape"],
                [f"{tag}/nought"],
                value=helper.make_tensor(f"{tag}/nought_value", buffer.type.tensor_type.elem_type, [1], [0]),
            ),
            helper.make_node("Where", [f"{tag}/head_mask", buffer.name, f"{tag}/nought"], [kept]),
        ]
    nodes.append(helper.make_node("Where", [f"{tag}/mask", f"{tag}/moved", kept], [f"{tag}/encoded"]))
    return nodes, f"{tag}/encoded"


def _buffer_name(name: str) -> str:
    """The If output the language graph reads instead of its input ``name``."""
    return ROWS if name == symbols.VISION_EMBEDS else f"single/{name}/read"


def compose(
    vision_path: Path,
    language_path: Path,
    images_symbol: str = symbols.BATCH_SIZE,
    encode_axis: int = -1,
):
    """The single-program ``ModelProto`` of an export's two graphs (external data not loaded).

    Every vision output must be a retained buffer input of the language graph: ``vision_embeds``
    (token-merge kind) or the cross-attention layers' K/V, named like those layers' cache inputs
    (cross-attention kind; ref: QEfficient ``models/mllama/modeling_mllama.py``
    ``get_output_names``, the ``kv_offload`` vision outputs, retained as ``past_key.{i}`` in its
    single QPC). The encode branch writes each at the front of its buffer.

    Args:
        vision_path: The vision graph.
        language_path: The language graph.
        images_symbol: The vision graph's symbol counting the images of one call (renamed
            ``num_images``; the family's ``vision_images_symbol``).
        encode_axis: The pixel input's axis gating the encoder (the family's
            ``single_encode_axis``): 1 in a keep specialization, larger in an encode one.

    Raises:
        UserError: A graph is unreadable, or not of the form this composition handles.
    """
    from onnx import TensorProto, helper

    vision, language = _load(vision_path), _load(language_path)
    vg, lg = vision.graph, language.graph
    lang_inputs = {value.name: value for value in lg.input}
    outputs = [value.name for value in vg.output]
    if not outputs or any(name not in lang_inputs for name in outputs):
        raise UserError(
            f"{vision_path}: deployment single composes a vision graph whose outputs are retained "
            f"inputs of the language graph (got {outputs})"
        )
    clash = sorted({value.name for value in vg.input} & set(lang_inputs))
    if clash:
        raise UserError(f"{vision_path}: vision inputs {clash} are also language inputs")
    pixel = vg.input[0]
    rank = len(pixel.type.tensor_type.shape.dim)
    if not -rank <= encode_axis < rank or (encode_axis < 0 and rank < 4):
        raise UserError(
            f"{vision_path}: deployment single gates the encoder on an axis of the first vision input: "
            f"its image side ([..., C, H, W]) or its declared patch axis "
            f"(got rank {rank}, axis {encode_axis})"
        )
    # The vision graph's values, prefixed, its weights hoisted to the outer graph (a branch reads them).
    _prefix_names(vg, keep={value.name for value in vg.input})
    _relocate_graph(vg, vision_path.parent.name)
    _relocate_graph(lg, language_path.parent.name)
    then_nodes, then_out, else_nodes, else_out = list(vg.node), [], [], []
    # The cross-attention kind keeps an earlier turn's images in their slots: a later turn's
    # images are written after them (token-merge rows are read by image_idx from the front).
    slotted = symbols.VISION_EMBEDS not in outputs
    slot = None
    if slotted:
        axes = [dim.dim_param for dim in pixel.type.tensor_type.shape.dim]
        if images_symbol not in axes:
            raise UserError(f"{vision_path}: a cross-attention vision graph needs an image-count axis")
        slot = (pixel.name, axes.index(images_symbol))
    for name, encoded in zip(outputs, (value.name for value in vg.output), strict=True):
        buffer = lang_inputs[name]
        # The token-merge kind writes at image_idx (several encode calls for a prompt's images).
        cursor = symbols.IMAGE_IDX if not slotted and symbols.IMAGE_IDX in lang_inputs else None
        nodes, written = _write_rows(helper, TensorProto, buffer, encoded, slot, cursor)
        then_nodes += nodes
        dtype = buffer.type.tensor_type.elem_type
        then_out.append(helper.make_tensor_value_info(written, dtype, None))
        else_nodes.append(helper.make_node("Identity", [name], [f"single/{name}/kept"]))
        else_out.append(helper.make_tensor_value_info(f"single/{name}/kept", dtype, None))
    gate = [
        # The image side is the last axis of the pixel input ([n, C, H, W], or mllama's
        # [batch, images, tiles, C, H, W]), a patch sequence's its patch axis: 1 in a keep
        # specialization, the images' otherwise.
        helper.make_node("Shape", [pixel.name], ["single/side"], **_axis_range(encode_axis)),
        _constant(helper, TensorProto, "single/keep_side", [KEEP_SIDE]),
        helper.make_node("Greater", ["single/side", "single/keep_side"], ["single/encode_1"]),
        helper.make_node("Squeeze", ["single/encode_1"], ["single/encode"]),
        helper.make_node(
            "If",
            ["single/encode"],
            [_buffer_name(name) for name in outputs],
            then_branch=helper.make_graph(then_nodes, "encode", [], then_out),
            else_branch=helper.make_graph(else_nodes, "keep", [], else_out),
        ),
    ]
    reads = {name: _buffer_name(name) for name in outputs}
    for node in lg.node:
        node.input[:] = [reads.get(name, name) for name in node.input]
    for value in vg.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = vision_symbol(dim.dim_param, images_symbol)
    # A fixed side (the last two axes only: mllama's tile and channel axes stay fixed) becomes
    # symbolic here, bound per entry (spec/single.py). A patch sequence's gate is its patch axis,
    # already symbolic; its fixed patch width stays fixed.
    for dim in pixel.type.tensor_type.shape.dim[-2:] if encode_axis == -1 else ():
        if not dim.dim_param:
            dim.dim_param = PIXEL_SIDE
    # QEfficient's order: input_ids, position_ids, pixel_values, ...; then the language's rest.
    names = [value.name for value in lg.input]
    at = min(names.index(name) for name in outputs)
    if symbols.POSITION_IDS in names:
        at = min(at, names.index(symbols.POSITION_IDS) + 1)
    slot = (
        [helper.make_tensor_value_info(symbols.FIRST_IMAGE_SLOT, TensorProto.INT64, [1])] if slotted else []
    )
    graph = helper.make_graph(
        gate + list(lg.node),
        "single",
        [*lg.input[:at], *vg.input, *slot, *lg.input[at:]],
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


def _axis_range(axis: int) -> dict[str, int]:
    """``Shape``'s start/end attributes selecting the one axis ``axis`` (negative from the end)."""
    return {"start": axis} if axis == -1 else {"start": axis, "end": axis + 1}


def _family(export_dir: Path):
    """The exported family (read from the export's record)."""
    from qeff_vision.export_record import read_export
    from qeff_vision.families import get_family

    return get_family(read_export(Path(export_dir))["family"])


def write_single_program(export_dir: Path, vision_path: Path, language_path: Path) -> Path:
    """Compose the export's graphs into ``export_dir/single.onnx`` (complete or absent).

    Raises:
        UserError: The graphs cannot be composed, or the file cannot be written.
    """
    import onnx

    target = single_program_path(export_dir)
    family = _family(export_dir)
    gate = family.single_program_gate  # this module owns SingleProgramGate
    model = compose(Path(vision_path), Path(language_path), gate.images_symbol, gate.encode_axis)
    staging = target.with_name(target.name + ".partial")
    try:
        onnx.save(model, str(staging))
        staging.replace(target)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise UserError(f"{target}: cannot write the single program: {exc}") from None
    return target
