"""What building the per-actor environments costs: the trainer and generator environments built
cold into a fresh cache root (uv's package cache as it is), then asked for again (warm: nothing
rebuilt). Prints one JSON line: wall seconds of each, each build's seconds and size.

    PYTHONPATH=bench ./run.sh python bench/env_build.py
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ceilings import emit

from tandem.cluster import envs

KINDS = ["trainer", "generator"]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-envs-") as root:
        os.environ[envs.ENV_DIR_VAR] = root
        builder = envs.EnvBuilder(root=Path(root))
        start = time.perf_counter()
        for kind in KINDS:
            builder.ensure(envs.spec_for(kind))
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = [builder.ensure(envs.spec_for(kind)) for kind in KINDS]
        warm_s = time.perf_counter() - start
        assert not any(info.built for info in warm), "the warm call rebuilt an environment"
        infos = {kind: builder.info(envs.spec_for(kind)) for kind in KINDS}
        emit(
            {
                "bench": "env_build",
                "cold_s": round(cold_s, 1),
                "warm_s": round(warm_s, 2),
                **{f"{k}_build_s": round(infos[k].build_seconds or 0.0, 1) for k in KINDS},
                **{f"{k}_size_gb": round(infos[k].size_bytes / 2**30, 2) for k in KINDS},
                "cpus": os.cpu_count(),
            }
        )


if __name__ == "__main__":
    main()
