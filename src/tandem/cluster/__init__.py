"""Ray side of tandem, the only package that imports ray.

- ``envs``: the actor kind -> environment registry, the uv environment builder, ``runtime_env_for``
  (imports ray only for ``build_on_all_nodes``).
- ``ray_cluster``: ``init_ray`` (join or start a local cluster).
- ``placement``: colocated / split placement groups.
- ``worker_group``: ``WorkerGroup`` (N actors of a plain worker class), ``WorkerError``.
- ``actors``, ``runtime``: the trainer/generator actors and the run's worker groups.
"""

import os

# Ray reads this once, when it is imported: a driver started by `uv run` would otherwise trigger
# Ray's uv hook (copy the working dir, build a fresh venv per job); tandem builds its own envs.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
