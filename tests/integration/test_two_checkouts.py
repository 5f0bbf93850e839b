"""Actors run the driver's source tree: a second checkout of tandem (a copy of ``src/`` with a
change) drives trainer and generator actors in their isolated environments, and both import
tandem from that copy, never from the checkout the environments were built from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tandem

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROBE = '''
"""Only in the second checkout: an actor that imports it runs that checkout."""
import tandem

class CheckoutProbe:
    def where(self) -> dict:
        return {"file": tandem.__file__, "marker": getattr(tandem, "CHECKOUT_MARKER", None)}
'''

DRIVER = """
import json, tandem
from tandem.cluster.worker_group import WorkerGroup
from tandem.cluster.ray_cluster import init_ray
from tandem._checkout_probe import CheckoutProbe
init_ray(num_cpus=4)
out = {"driver": tandem.__file__}
for kind in ("trainer", "generator"):
    group = WorkerGroup(CheckoutProbe, 1, kind, env_mode="isolated", num_cpus=1)
    out[kind] = group.run_rank0("where")
    group.shutdown()
print("RESULT " + json.dumps(out))
"""


def test_actors_import_tandem_from_the_drivers_checkout(tmp_path: Path) -> None:
    first_root = Path(tandem.__file__).resolve().parents[2]
    second = tmp_path / "second-checkout" / "src"
    shutil.copytree(Path(tandem.__file__).parent, second / "tandem")
    for name in ("pyproject.toml", "uv.lock", "README.md"):  # a checkout: the uv project too
        shutil.copy2(first_root / name, second.parent / name)
    init = second / "tandem" / "__init__.py"
    init.write_text(init.read_text() + '\nCHECKOUT_MARKER = "second"\n')
    (second / "tandem" / "_checkout_probe.py").write_text(PROBE)

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TANDEM_ENV_MODE")}
    env["PYTHONPATH"] = str(second)  # the second checkout comes before the installed one
    result = subprocess.run(
        [sys.executable, "-c", DRIVER],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    expected = str(second / "tandem" / "__init__.py")
    assert out["driver"] == expected
    for kind in ("trainer", "generator"):
        assert out[kind] == {"file": expected, "marker": "second"}, kind
    assert expected != tandem.__file__  # this test process runs the first checkout
