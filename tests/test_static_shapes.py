"""Every exported graph is static per specialization: no shape follows an input's values (issue 39).

The SDK compiler fixes each specialization's shapes from the symbols it binds; onnxruntime would
run a graph whose extents come from input values (a ``Range`` bounded by ``image_sizes``, a
``Slice`` at ``image_idx``), the device compiler would not. ``tests/graph_shapes.py`` follows
values from the graph inputs (``Shape`` cuts them) into ``If`` branches too, for each family's
vision and language graphs and the single program composed from them.
"""

from __future__ import annotations

import onnx
import pytest

from qeff_vision.compile.single_program import compose
from qeff_vision.families import all_families, get_family
from tests.graph_shapes import value_dependent_shapes

FAMILIES = [family.name for family in all_families()]


def _inputs(model) -> list[str]:
    return [value.name for value in model.graph.input]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_shape_follows_an_input_value(family, exported):
    export = exported(family)
    for program in ("vision", "lang"):
        model = onnx.load(export / program / "model.onnx", load_external_data=False)
        assert value_dependent_shapes(model, _inputs(model)) == [], program
    # The composed single program: its encode branch writes rows at image_idx / first_image_slot.
    described = get_family(family)
    single = compose(
        export / "vision" / "model.onnx",
        export / "lang" / "model.onnx",
        described.vision_images_symbol,
        described.single_encode_axis,
    )
    assert value_dependent_shapes(single, _inputs(single)) == []
