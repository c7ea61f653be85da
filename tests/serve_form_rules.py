"""The argument rules the printed vLLM forms must satisfy, written from each launcher's source.

* ``qaic-disagg`` (the guide's E-PD launcher, vLLM 0.8.5 container): its own flags plus vLLM's
  ``make_arg_parser`` minus the ones it removes (``--port`` is its proxy's, ``--device-group``,
  ``--override-qaic-config``, ``--max-num-seqs``, ``--max-seq-len-to-capture``, the parallel
  sizes); required ``--decode-max-num-seqs`` and decode device group/port; one device group per
  port; every port unique (with the proxy's) within 1..65535; no device id in two groups;
  override configs split on spaces then on the first ``:`` or ``=``, without ``stages`` /
  ``compile_only`` / ``mdp_load_partition_config``; ``VLLM_QAIC_QPC_PATH`` is unset by it.
* vLLM 0.23.0 + vllm-qaic: one program per instance from ``VLLM_QAIC_QPC_PATH=vision:language``
  (pooling runner first), one prefill length shared by both instances.
"""

from __future__ import annotations

import json
import re
import shlex

from qeff_vision.compile.vllm_handoff import serve_sections

LAUNCHER_FLAGS = {
    "--port",
    "--encode-port",
    "--prefill-port",
    "--decode-port",
    "--encode-max-num-seqs",
    "--prefill-max-num-seqs",
    "--decode-max-num-seqs",
    "--prefill-max-seq-len-to-capture",
    "--decode-max-seq-len-to-capture",
    "--encode-device-group",
    "--prefill-device-group",
    "--decode-device-group",
    "--encode-override-qaic-config",
    "--prefill-override-qaic-config",
    "--decode-override-qaic-config",
}
# The vLLM engine flags the printed E-PD form uses (vLLM's parser, kept by the launcher).
VLLM_FLAGS = {
    "--model",
    "--max-model-len",
    "--limit-mm-per-prompt",
    "--quantization",
    "--kv-cache-dtype",
    "--dtype",  # ai200 programs: bfloat16
}
VLLM_SWITCHES = {"--enable-prefix-caching"}
REMOVED = {
    "--device-group",
    "--override-qaic-config",
    "--max-num-seqs",
    "--max-seq-len-to-capture",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
}
FORBIDDEN_OVERRIDE_KEYS = {"stages", "compile_only", "mdp_load_partition_config"}


def launcher_override(text: str) -> dict[str, str]:
    """An override config as the launcher parses it (space-separated, split at the first ``:``/``=``)."""
    pairs = {}
    for item in re.split(r"[ ]+", text.strip()):
        parts = re.split(r"[:=]", item.strip())
        assert len(parts) == 2, f"override pair {item!r} does not split into key and value"
        pairs[parts[0]] = parts[1]
    return pairs


def _ids(text: str) -> list[int]:
    """A device group or port list: ``0,1,2`` or ``a..b``."""
    ids = []
    for part in text.split(","):
        if ".." in part:
            low, high = map(int, part.split(".."))
            ids += list(range(low, high + 1))
        else:
            ids.append(int(part))
    return ids


def launcher_args(epd_command: str) -> tuple[list[str], dict[str, str], set[str]]:
    """(docker words, launcher flag -> value, launcher switches) of the printed E-PD command."""
    words = shlex.split(epd_command.replace('"$PWD"', "OUT"))
    image = next(i for i, w in enumerate(words) if "cloud_ai_inference_vllm_disagg" in w)
    docker, rest = words[:image], words[image + 1 :]
    values, switches, index = {}, set(), 0
    while index < len(rest):
        flag = rest[index]
        assert flag.startswith("--"), f"stray word {flag!r}"
        if flag in VLLM_SWITCHES:
            switches.add(flag)
            index += 1
            continue
        assert flag in LAUNCHER_FLAGS | VLLM_FLAGS, f"{flag}: not an argument of qaic-disagg"
        assert flag not in values, f"{flag} given twice"
        values[flag] = rest[index + 1]
        index += 2
    return docker, values, switches


def check_epd(epd_command: str) -> dict[str, dict[str, str]]:
    """Assert the launcher's rules on the printed E-PD command; returns both override configs."""
    docker, values, switches = launcher_args(epd_command)
    assert not REMOVED & set(values), "a flag the launcher removes"
    assert "VLLM_QAIC_QPC_PATH" not in epd_command, "the launcher unsets VLLM_QAIC_QPC_PATH"
    for required in ("--decode-max-num-seqs", "--decode-device-group", "--decode-port", "--encode-port"):
        assert required in values, f"{required} is required here"
    assert "--enable-prefix-caching" in switches, "the text stage needs prefix caching"
    ports = [int(values.get("--port", 8000)), *_ids(values["--decode-port"]), *_ids(values["--encode-port"])]
    assert len(ports) == len(set(ports)) and all(1 <= p <= 65535 for p in ports), ports
    encode_groups = values["--encode-device-group"].split()
    assert len(encode_groups) == len(_ids(values["--encode-port"])), "one encode device group per port"
    ids = [*_ids(values["--encode-device-group"]), *_ids(values["--decode-device-group"])]
    assert len(ids) == len(set(ids)), f"a device id in two groups: {ids}"
    json.loads(values["--limit-mm-per-prompt"])
    overrides = {}
    for side in ("encode", "decode"):
        config = launcher_override(values[f"--{side}-override-qaic-config"])
        assert not FORBIDDEN_OVERRIDE_KEYS & set(config), f"{side}: a key the launcher refuses"
        assert "qpc_path" in config, f"{side}: the QPC goes in the override (VLLM_QAIC_QPC_PATH is unset)"
        overrides[side] = config
    assert {k: v for k, v in overrides["encode"].items() if k in ("height", "width")} == {
        k: v for k, v in overrides["decode"].items() if k in ("height", "width")
    }, "height/width must be given to both sides"
    assert (
        docker[:2] == ["docker", "run"] and "OUT:/out" in docker and docker[docker.index("-w") + 1] == "/out"
    )
    env = {docker[i + 1].split("=")[0] for i, w in enumerate(docker) if w == "-e"}
    assert {"HF_HOME", "QEFF_HOME"} <= env
    assert f"{ports[0]}:{ports[0]}" in docker, "the proxy port is published"
    return overrides


def plugin_serve_lines(plugin_serve: str) -> list[tuple[str, list[str]]]:
    """(VLLM_QAIC_QPC_PATH, ``vllm serve`` words) of each printed plugin endpoint."""
    lines = []
    for line in plugin_serve.splitlines():
        if line.startswith("#"):  # a note line (SAMPLER_NOT_SERVED), no endpoint
            continue
        words = shlex.split(line.removesuffix(" &"))
        env, _, value = words[0].partition("=")
        assert env == "VLLM_QAIC_QPC_PATH"
        lines.append((value, words[1:]))
    return lines


def check_plugin_serve(plugin_serve: str, seq_lens) -> None:
    """Two instances on one QPC path: pooling on index 0, generate (mm embeds) on index 1."""
    (path_v, vision), (path_l, language) = plugin_serve_lines(plugin_serve)
    assert path_v == path_l and len(path_v.split(":")) == 2
    assert vision[:2] == language[:2] == ["vllm", "serve"]
    assert vision[vision.index("--runner") + 1] == "pooling" and "--runner" not in language
    assert "--enable-mm-embeds" in language and "--enable-mm-embeds" not in vision
    threshold = {words[words.index("--long-prefill-token-threshold") + 1] for words in (vision, language)}
    assert len(threshold) == 1 and int(threshold.pop()) in seq_lens, "one compiled prefill length"
    assert all("--no-enable-prefix-caching" in words for words in (vision, language))
    assert vision[vision.index("--port") + 1] != language[language.index("--port") + 1]


def heredoc_body(script: str) -> str:
    """The Python of a printed ``python3 - <<'PY'`` form (note lines before it skipped)."""
    lines = script.splitlines()
    start = lines.index("python3 - <<'PY'")
    return "\n".join(lines[start + 1 : lines.index("PY", start)])


def sections(text: str) -> dict[str, str]:
    """Role -> command of a golden ``vllm_serve.txt``."""
    return serve_sections(text)
