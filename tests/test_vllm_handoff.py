"""The vLLM hand-off follows the Cloud AI multimodality guide's forms, golden per spec (issue 15 item 7).

``specs/golden/<spec>/vllm_serve.txt`` is what ``compile --print-serve`` prints for the spec (QPC
content keys written ``<hash>``); ``specialize --check`` regenerates it with the other golden files,
and tests/test_compile_driver.py checks that a real compile prints exactly that text.
"""

from __future__ import annotations

import json
import re
import shlex

from qeff_vision.compile.vllm_handoff import GOLDEN_FILE, QPC_PLACEHOLDER, golden_serve_text
from qeff_vision.families import all_families
from qeff_vision.spec import find_specs, load_spec
from tests.test_spec_helpers import SPECS

VISION_QPC, LANGUAGE_QPC = f"vision/{QPC_PLACEHOLDER}", f"lang/{QPC_PLACEHOLDER}"


def _launcher_pairs(text: str) -> dict[str, str]:
    """An override config as the qaic-disagg launcher reads it: space-separated ``key=value``."""
    return dict(re.split(r"[:=]", pair, maxsplit=1) for pair in text.split())


def _commands(spec):
    lines = (SPECS / "golden" / spec.name / GOLDEN_FILE).read_text().splitlines()
    assert lines[0].startswith("# dual QPC") and lines[2].startswith("# E-PD"), lines
    return shlex.split(lines[1]), shlex.split(lines[3])


def _option(words, flag):
    return words[words.index(flag) + 1]


def test_every_family_has_golden_vllm_commands_in_the_guide_forms():
    specs = [load_spec(path) for path in find_specs(SPECS)]
    for family in all_families():
        # The dual deployment's forms (a disaggregated spec's golden holds its compile commands).
        family_specs = [
            spec for spec in specs if spec.family == family.name and spec.deployment.mode == "dual"
        ]
        assert family_specs, f"family {family.name} has no spec under specs/"
        for spec in family_specs:
            golden = (SPECS / "golden" / spec.name / GOLDEN_FILE).read_text()
            assert golden == golden_serve_text(spec), f"{spec.name}: run specialize --update-golden"
            dual, epd = _commands(spec)
            # Dual QPC: VLLM_QAIC_QPC_PATH=vision_qpc:language_qpc and kv_offload true.
            assert dual[0] == f"VLLM_QAIC_QPC_PATH={VISION_QPC}:{LANGUAGE_QPC}"
            assert dual[1:4] == ["vllm", "serve", "model"]
            assert json.loads(_option(dual, "--override-qaic-config")) == {"kv_offload": True}
            assert _option(dual, "--max-model-len") == str(spec.ctx_len)
            assert _option(dual, "--max-seq-len-to-capture") == str(max(spec.prefill.seq_lens))
            # E-PD: the qaic-disagg launcher's flags.
            assert epd[:3] == ["qaic-disagg", "--model", "model"]
            still = next((image for image in spec.vision.images if not image.video), None)
            # A patch-bucket encoder takes any resolution: no height/width pair to pin.
            size = {} if still is None else {"height": str(still.height), "width": str(still.width)}
            assert _launcher_pairs(_option(epd, "--encode-override-qaic-config")) == {
                **size,
                "kv_offload": "True",
                "qpc_path": VISION_QPC,
            }
            assert bool(spec.vision.patch_buckets) == (still is None)
            assert _launcher_pairs(_option(epd, "--decode-override-qaic-config")) == {
                "kv_offload": "True",
                "qpc_path": LANGUAGE_QPC,
            }
            vision_devices = spec.compile.vision.num_devices
            language_devices = spec.compile.language.num_devices
            assert _option(epd, "--encode-device-group") == ",".join(map(str, range(vision_devices)))
            assert _option(epd, "--decode-device-group") == ",".join(
                map(str, range(vision_devices, vision_devices + language_devices))
            )
            # A continuous-batching spec decodes full_batch_size sequences per call.
            decode_batch = str(spec.full_batch_size or spec.batch_size)
            assert _option(epd, "--decode-max-num-seqs") == decode_batch
            assert _option(dual, "--max-num-seqs") == decode_batch
            assert _option(epd, "--encode-max-num-seqs") == "1"
            limit = {"image": spec.vision.max_images}
            assert json.loads(_option(epd, "--limit-mm-per-prompt")) == limit
            assert json.loads(_option(dual, "--limit-mm-per-prompt")) == limit
