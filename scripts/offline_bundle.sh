#!/usr/bin/env bash
# Pack what an air-gapped GPU machine lacks for tandem into one folder that travels with the
# checkout (docs/gpu.md). The target is assumed to have torch, transformers, safetensors, numpy
# and pyarrow already, and no network. The folder holds:
#   whl/          pydantic and its companions, Ray's pure-Python needs (jsonschema & co.),
#                 datasets (file data), trl (the side-by-side benchmarks), peft + accelerate
#                 (LoRA), megatron-core, torchao (bf16 stochastic rounding): binary wheels for
#                 the target's Python and platform
#   ray.tar.xz    Ray without its Java jars, its dashboard's web build and the libraries tandem
#                 does not use (rllib, tune, train, serve, data, llm): ~28 MB instead of ~79 MB
#   unpack.sh     run on the target: installs both into <folder>/site
#
# Usage (on a machine with PyPI access, from anywhere):
#   scripts/offline_bundle.sh [--out DIR] [--python-version 3.12] [--platform TAG ...]
#                             [--ray-version 2.60.0] [--dry-run]
# Defaults: DIR is .gpu in the checkout, CPython 3.12, manylinux x86_64 (2014 / 2_17 / 2_28).
# --dry-run prints the pip commands and downloads nothing. On the target:
#   bash DIR/unpack.sh && export PYTHONPATH=DIR/site:src RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out="$root/.gpu"
python_version=3.12
ray_version=2.60.0
platforms=()
dry_run=0
# The versions tandem is tested with (uv.lock's where it has them); unpinned ones take PyPI's latest.
packages=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  jsonschema referencing rpds-py jsonschema-specifications
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0
  peft==0.21.2 accelerate megatron-core==0.19.2 torchao==0.18.0
)

usage() { sed -n '13,18p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [ "$2" -ge 2 ] || { echo "offline_bundle.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case $1 in
    --out) need "$1" $#; out=$2; shift 2 ;;
    --python-version) need "$1" $#; python_version=$2; shift 2 ;;
    --platform) need "$1" $#; platforms+=("$2"); shift 2 ;;
    --ray-version) need "$1" $#; ray_version=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "offline_bundle.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case $python_version in
  [0-9].[0-9]|[0-9].[0-9][0-9]) ;;
  *) echo "offline_bundle.sh: --python-version takes MAJOR.MINOR, e.g. 3.12 (got '$python_version')" >&2
     exit 2 ;;
esac
[ ${#platforms[@]} -gt 0 ] ||
  platforms=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64)

target=(--only-binary=:all: --no-deps --implementation cp --python-version "$python_version")
for p in "${platforms[@]}"; do target+=(--platform "$p"); done
wheels=(python3 -m pip download -q "${target[@]}" -d "$out/whl" "${packages[@]}")
ray_tmp=$(mktemp -d)
trap 'rm -rf "$ray_tmp"' EXIT
ray=(python3 -m pip download -q "${target[@]}" -d "$ray_tmp" "ray==$ray_version")

if [ "$dry_run" = 1 ]; then
  echo "would write $out (whl/, ray.tar.xz, unpack.sh) with:"
  printf '%q ' "${wheels[@]}"; echo
  printf '%q ' "${ray[@]}"; echo
  exit 0
fi

mkdir -p "$out/whl"
"${wheels[@]}"
if [ ! -f "$out/ray.tar.xz" ]; then
  "${ray[@]}"
  mkdir "$ray_tmp/x"
  unzip -q "$ray_tmp"/ray-*.whl -d "$ray_tmp/x"  # unzip keeps the executables' mode bits
  (cd "$ray_tmp/x" &&
   rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/llm ray/dashboard/client/build &&
   tar -cJf "$out/ray.tar.xz" .)
fi

cat > "$out/unpack.sh" <<'SH'
#!/usr/bin/env bash
# On the offline machine: install the packed wheels and Ray into site/ next to this script.
# Then: export PYTHONPATH=<this folder>/site:<checkout>/src RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$here/site" "$here"/whl/*.whl
tar -xJf "$here/ray.tar.xz" -C "$here/site"
SH
chmod +x "$out/unpack.sh"
du -sh "$out"
