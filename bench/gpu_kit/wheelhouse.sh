#!/usr/bin/env bash
# Builds .whl/ (the repo root's, git-ignored) from bench/gpu_kit/wheels.txt: one wheel per pin, for
# the GPU machine (CPython 3.12, manylinux x86-64), no dependencies fetched (wheels.txt names them
# all). Idempotent: a pin already there is not fetched again, a wheel no pin names is removed.
# Prints the total size and fails above WHEELHOUSE_MAX_MIB (60: the tree that travels to the GPU
# machine is limited to 64 MiB). Needs network to PyPI unless every pin is already there.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${WHEELHOUSE_DIR:-.whl}
MAX_MIB=${WHEELHOUSE_MAX_MIB:-60}
PIP_PY=${PIP_PYTHON:-python3}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
mkdir -p "$DEST"

norm() { tr 'A-Z.-' 'a-z__' <<<"$1"; }
pins=()
while read -r line; do
  line=${line%%#*}
  line=${line//[[:space:]]/}
  [[ -n $line ]] && pins+=("$line")
done <bench/gpu_kit/wheels.txt

wanted=()
for pin in "${pins[@]}"; do
  name=${pin%%==*} version=${pin#*==}
  [[ $pin == *==* && -n $version ]] || { echo "wheels.txt: '$pin' is not NAME==VERSION" >&2; exit 1; }
  key="$(norm "$name")-$version-"
  wanted+=("$key")
  if ls "$DEST" | tr 'A-Z' 'a-z' | grep -q "^${key//./\\.}"; then
    echo "have $pin"
    continue
  fi
  args=()
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  echo "fetching $pin"
  "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${args[@]}" -d "$DEST" "$pin"
done

# a wheel no pin names (an older version, a package dropped from the list) would go along and
# install too: two versions of one package stop the whole install there
for file in "$DEST"/*; do
  base=$(basename "$file" | tr 'A-Z' 'a-z')
  keep=no
  for key in "${wanted[@]}"; do [[ $base == "$key"* ]] && keep=yes; done
  if [[ $keep == no ]]; then
    echo "removing $(basename "$file") (no pin in wheels.txt names it)"
    rm -rf -- "$file"
  fi
done

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "$DEST: $count wheels, $mib MiB (limit $MAX_MIB MiB)"
[[ $count -eq ${#pins[@]} ]] || { echo "expected ${#pins[@]} wheels, found $count" >&2; exit 1; }
if ((bytes > MAX_MIB * 1048576)); then
  echo "$DEST is over $MAX_MIB MiB: the working tree that travels to the GPU machine is limited to 64 MiB" >&2
  exit 1
fi
