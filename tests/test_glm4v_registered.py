"""GLM-4.1V registered in a subprocess: the registry's parity suite and its own tests pass for it.

The family does not register itself at import until its published config is pinned with a spec
(see qeff_vision/families/glm4v/__init__.py); registering it inside this session would change
what every registry-parametrized file collected. A fresh interpreter registers it first, then runs
the parity file (vision three-stage, patched decoder vs transformers' forward, one chunk + 8 greedy
decode steps on onnxruntime with tokens identical to transformers' ``generate``, fp32) and
tests/test_glm4v_family.py for it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ("tests/test_family_parity.py", "tests/test_glm4v_family.py")
# 3 parity cases + 9 of the family's own; fewer means the family was not collected.
EXPECTED = 12


def test_parity_and_host_tests_pass_with_the_family_registered():
    code = (
        "import sys, pytest\n"
        "from qeff_vision.families.glm4v import register_glm4v\n"
        "register_glm4v()\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'glm4v', *{list(FILES)!r}]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= EXPECTED, tail
    assert "skipped" not in run.stdout.splitlines()[-1], tail
