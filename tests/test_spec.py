"""Spec loading: schema strictness, every error type of the issue, many errors at once, fuzzing."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qeff_vision import families
from qeff_vision.errors import SpecError, UserError
from qeff_vision.families.base import Family, Features, ImageSize, no, yes
from qeff_vision.spec import VisionSizePolicy, load_spec
from qeff_vision.spec.policy import FIXED
from qeff_vision.spec.strict_yaml import load_strict_yaml
from tests.test_spec_helpers import CONFIG_3B, DELETE, problems_of, spec_data, write_spec


def one(problems: list[str], prefix: str) -> str:
    found = [p for p in problems if p.startswith(prefix)]
    assert len(found) == 1, (prefix, problems)
    return found[0]


# ---- a valid spec ----


def test_valid_spec_loads_with_defaults(tmp_path):
    spec = load_spec(write_spec(tmp_path, spec_data(prefill={"seq_lens": [512, 128]})))
    assert spec.family == "qwen2_5_vl"
    assert spec.prefill.seq_lens == (128, 512)  # sorted
    assert spec.vision.images == (ImageSize(354, 536),)
    assert (spec.batch_size, spec.dtype, spec.layout, spec.vision.max_images) == (1, "float32", "flat", 1)
    assert spec.vision.vision_size == VisionSizePolicy("chunk")
    assert spec.compile.language.kv_cache_dtype == "float16"
    assert spec.config_path == CONFIG_3B and spec.model_dir is None
    assert spec.warnings == ()


def test_name_defaults_to_file_stem_and_config_is_relative_to_the_spec(tmp_path):
    snapshot = tmp_path / "configs" / "config.json"
    snapshot.parent.mkdir()
    snapshot.write_text(CONFIG_3B.read_text())
    (tmp_path / "nested").mkdir()
    data = spec_data(name=DELETE, config="../configs/config.json")
    spec = load_spec(write_spec(tmp_path / "nested", data, "my-model.yaml"))
    assert spec.name == "my-model"
    assert spec.config_path.resolve() == snapshot.resolve()


def test_model_directory_is_read_without_a_config_key(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(CONFIG_3B.read_text())
    # A checkpoint's own image-processor config wins over the family defaults.
    (checkpoint / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 64 * 28 * 28}))
    data = spec_data(model="ckpt", config=DELETE, vision={"images": [{"height": 1080, "width": 1920}]})
    spec = load_spec(write_spec(tmp_path, data))
    assert spec.model_dir == checkpoint
    family = families.get_family(spec.family)
    assert family.image_tokens(spec.model_description, ImageSize(1080, 1920)) <= 64


def test_integer_policy_warns_when_an_image_needs_chunking(tmp_path):
    data = spec_data(
        vision={
            "images": [{"height": 1080, "width": 1920}, {"height": 224, "width": 224}],
            "vision_size": 1024,
        }
    )
    spec = load_spec(write_spec(tmp_path, data))
    assert spec.vision.vision_size == VisionSizePolicy(FIXED, 1024)
    assert len(spec.warnings) == 1
    assert spec.warnings[0].startswith("vision.images[0]: 1080x1920 becomes 2691 image tokens")
    assert "chunking required" in spec.warnings[0]


# ---- every error type of the issue ----


def test_vision_size_not_smaller_than_ctx_len(tmp_path):
    problems = problems_of(write_spec(tmp_path, spec_data(vision={"vision_size": 8192})))
    assert one(problems, "vision.vision_size:") == (
        "vision.vision_size: vision_size 8192 must be smaller than ctx_len 8192"
    )


def test_seq_len_over_ctx_len(tmp_path):
    problems = problems_of(write_spec(tmp_path, spec_data(ctx_len=4096, prefill={"seq_lens": [128, 8192]})))
    assert one(problems, "prefill.seq_lens[1]:") == "prefill.seq_lens[1]: seq_len 8192 exceeds ctx_len 4096"


def test_images_that_cannot_fit_ctx_len(tmp_path):
    # 2691 tokens fit 4096 once, not three times.
    data = spec_data(ctx_len=4096, vision={"images": [{"height": 1080, "width": 1920}], "max_images": 3})
    problem = one(problems_of(write_spec(tmp_path, data)), "vision.images[0]:")
    assert "2691 image tokens x 3 images per request = 8073 rows" in problem
    assert "does not fit ctx_len 4096" in problem
    data = spec_data(ctx_len=2048, vision={"images": [{"height": 1080, "width": 1920}]})
    assert "does not fit ctx_len 2048" in one(problems_of(write_spec(tmp_path, data)), "vision.images[0]:")


def test_aspect_ratio_over_200(tmp_path):
    data = spec_data(vision={"images": [{"height": 354, "width": 536}, {"height": 28, "width": 5628}]})
    assert one(problems_of(write_spec(tmp_path, data)), "vision.images[1]:") == (
        "vision.images[1]: aspect ratio of 28x5628 exceeds 200"
    )


def test_duplicate_buckets_and_images(tmp_path):
    data = spec_data(
        prefill={"seq_lens": [128, 512, 128]},
        vision={"images": [{"height": 354, "width": 536}, {"height": 354, "width": 536, "frames": 1}]},
    )
    problems = problems_of(write_spec(tmp_path, data))
    assert one(problems, "prefill.seq_lens[2]:") == (
        "prefill.seq_lens[2]: duplicate bucket 128 (also prefill.seq_lens[0])"
    )
    assert "duplicate image 354x536" in one(problems, "vision.images[1]:")


class CrossAttentionFamily(Family):
    """A cross-attention family: its decoder takes a fixed number of image rows."""

    name = "test_cross_attention"
    title = "Test cross-attention"
    architectures = ("TestCrossAttentionForConditionalGeneration",)
    features = Features(
        export=yes(),
        dynamic_vision_size=no("cross-attention over a fixed number of image rows"),
        multi_resolution=no("one tile size"),
        chunk_split=no("image rows are not placeholders"),
        video=no("images only"),
    )
    vision_input_axes = {"pixel_values": {0: "batch_size"}}

    def vision_symbols(self, model, image):
        return {"vision_size": 1601}


@pytest.fixture
def cross_attention_config(tmp_path, monkeypatch):
    families.all_families()  # discover the real ones first
    monkeypatch.setitem(families._REGISTRY, CrossAttentionFamily.name, CrossAttentionFamily())
    config = tmp_path / "cross.json"
    config.write_text(
        json.dumps(
            {
                "architectures": list(CrossAttentionFamily.architectures),
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 100,
                "image_token_id": 99,  # required by the family's config view, as in every real config
            }
        )
    )
    return config


def test_vision_size_given_to_a_family_without_dynamic_vision_size(tmp_path, cross_attention_config):
    data = spec_data(model="test/cross", config=str(cross_attention_config), prefill={"seq_lens": [2048]})
    assert load_spec(write_spec(tmp_path, data)).family == CrossAttentionFamily.name
    data["vision"]["vision_size"] = "chunk"
    assert one(problems_of(write_spec(tmp_path, data)), "vision.vision_size:") == (
        "vision.vision_size: family test_cross_attention has no dynamic vision size "
        "(cross-attention over a fixed number of image rows); remove this key"
    )


def test_family_that_cannot_split_images_needs_a_bucket_holding_the_whole_image(
    tmp_path, cross_attention_config
):
    data = spec_data(model="test/cross", config=str(cross_attention_config), prefill={"seq_lens": [128, 512]})
    problem = one(problems_of(write_spec(tmp_path, data)), "vision.images[0]:")
    assert "(1601 image rows)" in problem and "cannot split an image across chunks" in problem
    assert "(seq_len: 128, 512)" in problem and problem.endswith("add a bucket with seq_len >= 1601")


# ---- schema strictness ----


def test_schema_problems_carry_their_yaml_path(tmp_path):
    data = spec_data(
        ctx_len="8k",
        batch_size=0,
        dtype="bfloat16",
        specialization_layout="tree",
        vison={},
        prefill={"seq_lens": []},
        vision={
            "images": [{"height": 354, "width": 536}, {"height": -1, "width": 640, "depth": 3}],
            "max_images": True,
            "vision_size": "all",
        },
    )
    problems = problems_of(write_spec(tmp_path, data))
    assert one(problems, "ctx_len:") == "ctx_len: must be a positive integer (got '8k')"
    assert one(problems, "batch_size:") == "batch_size: must be a positive integer (got 0)"
    assert one(problems, "dtype:") == "dtype: must be one of float32, float16 (got 'bfloat16')"
    assert one(problems, "specialization_layout:").startswith("specialization_layout: must be one of flat")
    assert "did you mean 'vision'?" in one(problems, "vison:")
    assert one(problems, "prefill.seq_lens:").startswith("prefill.seq_lens: must be a non-empty list")
    assert one(problems, "vision.images[1].height:") == (
        "vision.images[1].height: must be a positive integer (got -1)"
    )
    assert one(problems, "vision.images[1].depth:").startswith("vision.images[1].depth: unknown key")
    assert one(problems, "vision.max_images:") == "vision.max_images: must be a positive integer (got True)"
    assert one(problems, "vision.vision_size:").startswith("vision.vision_size: must be chunk or max")


def test_missing_required_keys_and_empty_file(tmp_path):
    problems = problems_of(write_spec(tmp_path, {"name": "x"}))
    assert {p.split(":")[0] for p in problems} == {"model", "ctx_len", "prefill", "vision"}
    assert all(p.endswith(": is required") for p in problems)
    assert problems_of(write_spec(tmp_path, "")) == ["<top level>: the spec is empty"]
    assert problems_of(write_spec(tmp_path, "- a\n- b\n"))[0].startswith("<top level>: must be a mapping")


def test_decode_shape_is_not_a_prefill_bucket(tmp_path):
    problems = problems_of(write_spec(tmp_path, spec_data(prefill={"seq_lens": [1, 128]})))
    assert one(problems, "prefill.seq_lens[0]:").startswith("prefill.seq_lens[0]: 1 is the decode shape")


def test_compile_section_is_validated_by_the_compile_options(tmp_path):
    data = spec_data(compile={"num_cores": 99, "language": {"kv_cache_dtype": "int4"}, "vision": {"fast": 1}})
    problems = problems_of(write_spec(tmp_path, data))
    assert one(problems, "compile.num_cores:").startswith("compile.num_cores: must be at most 16")
    assert one(problems, "compile.language.kv_cache_dtype:").startswith(
        "compile.language.kv_cache_dtype: must be one of float16, mxint8"
    )
    assert one(problems, "compile.vision.fast:").startswith("compile.vision.fast: unknown key")


def test_model_and_config_resolution_problems(tmp_path):
    assert "add `config:`" in one(
        problems_of(write_spec(tmp_path, spec_data(model="nobody/not-cached-anywhere", config=DELETE))),
        "model:",
    )
    assert one(problems_of(write_spec(tmp_path, spec_data(config="missing.json"))), "config:").startswith(
        "config: config snapshot"
    )
    assert "neither a directory" in one(
        problems_of(write_spec(tmp_path, spec_data(model="./no/such dir"))), "model:"
    )
    assert one(problems_of(write_spec(tmp_path, spec_data(family="no_such_family"))), "family:").startswith(
        "family: unknown family 'no_such_family'; supported families: "
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert "architecture LlamaForCausalLM is not supported" in one(
        problems_of(write_spec(tmp_path, spec_data(config=str(other)))), "config:"
    )
    assert "does not accept architecture LlamaForCausalLM" in one(
        problems_of(write_spec(tmp_path, spec_data(config=str(other), family="qwen2_5_vl"))), "family:"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not a readable JSON file" in one(
        problems_of(write_spec(tmp_path, spec_data(config=str(bad)))), "config:"
    )


def test_file_level_problems(tmp_path):
    assert problems_of(tmp_path / "absent.yaml") == ["file not found"]
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00name")
    assert problems_of(tmp_path / "binary.yaml")[0].startswith("cannot read the file")
    problems = problems_of(write_spec(tmp_path, "name: [unclosed\nmodel: x\n"))
    assert len(problems) == 1 and problems[0].startswith("YAML syntax:") and "line" in problems[0]
    assert problems_of(write_spec(tmp_path, "a: 1\n---\nb: 2\n"))[0].startswith("YAML syntax:")


def test_duplicate_and_non_string_keys_are_rejected_with_their_path(tmp_path):
    text = (
        "name: x\nctx_len: 4096\nctx_len: 8192\n"
        "vision:\n  images:\n    - {height: 1, width: 2, height: 3}\n"
        "1: one\n"
    )
    problems = problems_of(write_spec(tmp_path, text))
    assert one(problems, "ctx_len:") == "ctx_len: duplicate key (first at line 2, again at line 3, column 1)"
    assert one(problems, "vision.images[0].height:").startswith("vision.images[0].height: duplicate key")
    assert one(problems, "<top level>:").startswith("<top level>: key '1' must be a string")
    # Anchors and aliases are refused (a recursive one included) before anything is composed.
    data, found = load_strict_yaml("a: &x {b: 1}\nc: *x\nd: &y [*y]\n")
    assert data is None and found == ["YAML anchor &x is not allowed in a spec (line 1, column 4)"]
    data, found = load_strict_yaml("a: *nowhere\n")
    assert data is None and found == ["YAML alias *nowhere is not allowed in a spec (line 1, column 4)"]


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A spec whose ``ctx_len`` is ``width`` ** ``levels`` values through nested aliases."""
    lines = ["model: Qwen/Qwen2.5-VL-3B-Instruct", f"l0: &l0 [{', '.join(['1'] * width)}]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    lines.append(f"ctx_len: [{', '.join([f'*l{levels - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("command", ["validate", "specialize"])
def test_an_alias_bomb_is_answered_within_a_second_in_one_line(tmp_path, command):
    spec = tmp_path / "bomb.yaml"
    spec.write_text(alias_bomb())
    argv = [sys.executable, "-m", "qeff_vision", command, str(spec)]
    if command == "specialize":
        argv += ["-o", str(tmp_path / "out")]
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    answered = time.perf_counter() - started
    problems = [line for line in done.stderr.splitlines() if "anchor &l0 is not allowed" in line]
    assert done.returncode == 2, done.stderr
    assert len(problems) == 1, done.stderr
    assert len(done.stderr) < 400 and "Traceback" not in done.stderr
    if command == "specialize":
        assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    # The interpreter start and CLI import take part of the second; the answer itself is instant.
    assert answered < 1.0 + _python_startup(), answered


def _python_startup() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import qeff_vision.cli"], check=True, timeout=60)
    return time.perf_counter() - started


def test_messages_quote_a_huge_value_in_bounded_text(tmp_path):
    huge = [list(range(row, row + 1000)) for row in range(100)]
    problems = problems_of(write_spec(tmp_path, spec_data(ctx_len=huge)))
    assert len(one(problems, "ctx_len:")) < 200


def test_several_errors_in_one_file_are_reported_at_once(tmp_path):
    data = spec_data(
        ctx_len=4096,
        prefill={"seq_lens": [128, 128, 8192]},
        vision={
            "images": [
                {"height": 28, "width": 5628},
                {"height": 1365, "width": 2048},
                {"height": "tall", "width": 10},
            ],
            "max_images": 2,
            "vision_size": 4096,
        },
        compile={"num_devices": 0},
        extra=1,
    )
    path = write_spec(tmp_path, data)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    problems = info.value.problems
    for prefix in (
        "prefill.seq_lens[1]: duplicate bucket",
        "prefill.seq_lens[2]: seq_len 8192 exceeds",
        "vision.images[2].height: must be a positive integer",
        "vision.vision_size: vision_size 4096",
        "compile.num_devices: must be a positive integer",
        "extra: unknown key",
        # The model checks still run on the images that parsed, although images[2] did not.
        "vision.images[0]: aspect ratio of 28x5628 exceeds 200",
        "vision.images[1]: 1365x2048 becomes 3577 image tokens x 2 images per request = 7154 rows",
    ):
        one(problems, prefix)
    # Problems of different sections do not hide each other.
    assert len(problems) == 8
    message = str(info.value)
    assert message.startswith(f"{path}: 8 problem(s): ") and "\n" not in message


def test_semantic_checks_run_when_unrelated_sections_are_broken(tmp_path):
    data = spec_data(compile={"num_cores": 0}, vision={"images": [{"height": 28, "width": 5628}]})
    problems = problems_of(write_spec(tmp_path, data))
    one(problems, "compile.num_cores:")
    one(problems, "vision.images[0]: aspect ratio")


# ---- random documents never escape as a traceback ----

SCHEMA_WORDS = [
    "name",
    "model",
    "family",
    "config",
    "dtype",
    "batch_size",
    "ctx_len",
    "prefill",
    "seq_lens",
    "vision",
    "images",
    "height",
    "width",
    "frames",
    "max_images",
    "vision_size",
    "compile",
    "specialization_layout",
    "chunk",
    "max",
    "flat",
    "named",
    "auto",
    "qwen2_5_vl",
    "num_cores",
    "language",
    "kv_cache_dtype",
    "mxint8",
    "float16",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.sampled_from(SCHEMA_WORDS)
    | st.text(max_size=12)
)
documents = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(SCHEMA_WORDS) | st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=25,
)


def _load_or_user_error(path: Path) -> None:
    try:
        load_spec(path)
    except UserError:  # SpecError included; anything else is a bug
        pass


_SCRATCH = Path(tempfile.mkdtemp(prefix="qeff-spec-fuzz-"))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=300))
def test_random_text_never_raises_a_traceback(text):
    path = _SCRATCH / "text.yaml"
    path.write_text(text, encoding="utf-8")
    _load_or_user_error(path)


@FUZZ
@given(documents)
def test_random_documents_never_raise_a_traceback(document):
    _load_or_user_error(write_spec(_SCRATCH, yaml.safe_dump(document), "doc.yaml"))


@FUZZ
@given(
    st.sampled_from(
        [
            ("ctx_len",),
            ("batch_size",),
            ("prefill",),
            ("prefill", "seq_lens"),
            ("vision",),
            ("vision", "images"),
            ("vision", "max_images"),
            ("vision", "vision_size"),
            ("compile",),
            ("family",),
            ("dtype",),
            ("name",),
            ("model",),
        ]
    ),
    documents,
    st.lists(st.integers(1, 6000), min_size=1, max_size=3),
)
def test_mutated_valid_specs_never_raise_a_traceback(where, value, sides):
    data = spec_data(vision={"images": [{"height": sides[0], "width": sides[-1]}]})
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    _load_or_user_error(write_spec(_SCRATCH, yaml.safe_dump(data), "mutated.yaml"))


def test_chunk_table_of_a_family_that_cannot_split_images(tmp_path, cross_attention_config):
    from qeff_vision.spec import build_specializations, specialization_table

    data = spec_data(
        model="test/cross", config=str(cross_attention_config), prefill={"seq_lens": [128, 2048]}
    )
    result = build_specializations(load_spec(write_spec(tmp_path, data)))
    assert dict(result.images[0].chunks) == {128: (0, 0), 2048: (1, 1)}
    row = next(line for line in specialization_table(result).splitlines() if line.startswith("354x536"))
    assert row.split()[-2:] == ["-", "1"]
