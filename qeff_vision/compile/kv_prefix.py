"""The language graph with ``kv_cache_prefix`` KV names, for a disaggregated deployment.

QEfficient's ``kv_cache_prefix`` export names the caches ``past_key.{i}_<prefix>`` and their
retained outputs ``past_key.{i}_<prefix>_RetainedState`` so vLLM's prefill/decode hand-off finds
them by pattern. The graph is otherwise the export's: this pass renames those graph inputs and
outputs (and every node reference to them) in a copy written beside the export's language graph
(``lang/model.<prefix>.onnx``), which reads the same external-data file: nothing large is copied.
(onnx refuses external data reached through a link, so the copy cannot live under another
directory without copying the weights.)
"""

from __future__ import annotations

from pathlib import Path

from qeff_vision.contract.slot_names import is_slot_name, with_kv_prefix_name
from qeff_vision.errors import UserError


def prefixed_language(source: Path, prefix: str) -> Path:
    """Where the renamed copy of the language graph ``source`` lives (whether written yet or not)."""
    source = Path(source)
    return source.with_name(f"{source.stem}.{prefix}{source.suffix}")


def _rename_graph(graph, mapping: dict[str, str]) -> None:
    """Rename every reference to a key of ``mapping`` in ``graph`` and its subgraphs."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name in mapping:
            value.name = mapping[value.name]
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in mapping:
                node.input[index] = mapping[name]
        for index, name in enumerate(node.output):
            if name in mapping:
                node.output[index] = mapping[name]
        for attribute in node.attribute:
            if attribute.HasField("g"):
                _rename_graph(attribute.g, mapping)
            for subgraph in attribute.graphs:
                _rename_graph(subgraph, mapping)


def write_prefixed_language(source: Path, prefix: str) -> Path:
    """Write the language graph ``source`` with ``prefix`` on its KV names, beside it.

    Returns:
        The renamed graph's path.

    Raises:
        UserError: ``source`` is not a readable ONNX file, it has no KV input to rename, or its
            directory is not writable.
    """
    import onnx

    target = prefixed_language(source, prefix)
    try:
        model = onnx.load(str(source), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user error
        raise UserError(f"{source}: not a readable ONNX graph ({exc.__class__.__name__})") from None
    graph = model.graph
    names = [v.name for v in (*graph.input, *graph.output)]
    mapping = {name: with_kv_prefix_name(name, prefix) for name in names if is_slot_name(name)}
    if not mapping:
        raise UserError(f"{source}: no KV cache input to give the prefix {prefix!r}")
    _rename_graph(graph, mapping)
    staging = target.with_name(target.name + ".partial")
    try:
        onnx.save(model, str(staging))
        staging.replace(target)  # complete or absent: never a half-written graph
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise UserError(
            f"{target}: cannot write the {prefix!r} KV copy of the language graph: {exc}"
        ) from None
    return target
