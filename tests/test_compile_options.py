import pytest

from qeff_vision.spec.compile_options import CompileOptions, ProgramOptions, parse_compile_options


def test_absent_section_gives_defaults():
    options, problems = parse_compile_options(None)
    assert problems == []
    assert options == CompileOptions()
    assert options.language.mxfp6_matmul is True
    assert options.vision.mxfp6_matmul is False
    assert options.language.kv_cache_dtype == "float16"
    assert options.vision.num_cores == 16 and options.vision.num_devices == 1


def test_shared_defaults_and_program_overrides():
    options, problems = parse_compile_options(
        {
            "num_cores": 8,
            "kv_cache_dtype": "mxint8",
            "aic_hw_version": 2.0,
            "vision": {"mxfp6_matmul": True, "timeout": 60},
            "language": {"num_devices": 4, "mxfp6_matmul": False, "mos": 1, "ols": 2, "depth_first": True},
        }
    )
    assert problems == []
    assert options.vision == ProgramOptions(
        num_cores=8, mxfp6_matmul=True, aic_hw_version="2.0", timeout=60.0
    )
    assert options.language == ProgramOptions(
        num_cores=8,
        num_devices=4,
        mxfp6_matmul=False,
        mos=1,
        ols=2,
        depth_first=True,
        aic_hw_version="2.0",
        kv_cache_dtype="mxint8",
    )
    assert options.program("lang") is options.language


def test_every_problem_reported_with_its_yaml_path():
    _, problems = parse_compile_options(
        {
            "num_cores": 0,
            "bogus": 1,
            "vision": {"kv_cache_dtype": "mxint8", "num_devices": "two", "mxfp6_matmul": "yes"},
            "language": {
                "num_cores": 32,
                "kv_cache_dtype": "int4",
                "timeout": -1,
                "mos": True,
                "extra_flags": "-foo",
            },
        },
        path="spec.compile",
    )
    assert sorted(problems) == sorted(
        [
            "spec.compile.num_cores: must be a positive integer",
            "spec.compile.bogus: unknown key; allowed: num_cores, num_devices, mxfp6_matmul, "
            "convert_to_fp16, mos, ols, depth_first, aic_hw_version, kv_cache_dtype, state_dtype, timeout, "
            "node_precision, split_model_io, allow_mxint8_mdp_io, split_retained_state_io, sampler, "
            "subfunctions, vision, language, comp_ctx_lengths, calibration, max_activation_bytes",
            "spec.compile.vision.kv_cache_dtype: applies to the language program only",
            "spec.compile.vision.num_devices: must be a positive integer",
            "spec.compile.vision.mxfp6_matmul: must be true or false",
            "spec.compile.language.num_cores: must be at most 16 (cores of one device)",
            "spec.compile.language.kv_cache_dtype: must be one of float16, mxint8, bfloat16 (got 'int4')",
            "spec.compile.language.timeout: must be a positive number of seconds",
            "spec.compile.language.mos: must be a positive integer",
            "spec.compile.language.extra_flags: unknown key; allowed: num_cores, num_devices, mxfp6_matmul, "
            "convert_to_fp16, mos, ols, depth_first, aic_hw_version, kv_cache_dtype, state_dtype, timeout, "
            "node_precision, split_model_io, allow_mxint8_mdp_io, split_retained_state_io, sampler, "
            "subfunctions",
        ]
    )


@pytest.mark.parametrize("bad", [[], "fast", 3])
def test_section_must_be_a_mapping(bad):
    _, problems = parse_compile_options(bad)
    assert problems == ["compile: must be a mapping of compiler options"]
    _, problems = parse_compile_options({"language": bad})
    assert problems == ["compile.language: must be a mapping of compiler options"]


def test_max_activation_bytes_is_a_byte_count_or_null():
    """Default 256 MiB; ``null`` lifts the bound; anything else is a problem with its path."""
    assert parse_compile_options(None)[0].max_activation_bytes == 256 << 20
    assert parse_compile_options({"max_activation_bytes": 1 << 30})[0].max_activation_bytes == 1 << 30
    assert parse_compile_options({"max_activation_bytes": None})[0].max_activation_bytes is None
    for bad in (0, -5, "256MiB", True, 1.5):
        _, problems = parse_compile_options({"max_activation_bytes": bad}, path="c")
        assert len(problems) == 1 and problems[0].startswith("c.max_activation_bytes: must be a positive")
    _, problems = parse_compile_options({"vision": {"max_activation_bytes": 5}}, path="c")
    assert problems[0].startswith("c.vision.max_activation_bytes: unknown key")
