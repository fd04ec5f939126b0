#!/usr/bin/env bash
# Builds FlashKDA (https://github.com/MoonshotAI/FlashKDA, MIT licence) on the GPU box for the KDA benchmark's
# FlashKDA provider (kda_compile/bench/kda_providers.py). No FlashKDA or CUTLASS code is in this repository:
# the sources come as two tarballs in the ignored folder .flashkda/, carried to the device like .whl/:
#   .flashkda/flashkda.tgz  `git archive` of FlashKDA (the commit is in the tarball's pax header)
#   .flashkda/cutlass.tgz   CUTLASS at the submodule commit FlashKDA pins (include/, tools/util/include/,
#                           examples/common/: the include paths of its setup.py)
# usage: bash .ci/flashkda_build.sh [TARGET]   installs into TARGET (default /tmp/site_fk; put it on PYTHONPATH).
# Environment: FLASH_KDA_CUDA_ARCHS (default 90a, the H100), NVCC_THREADS (default 16), CUDA_HOME (found
# when unset). Takes about 130 s on 16 cores; prints how long it took. A TARGET that already imports is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${FLASHKDA_SRC:-$PWD/.flashkda}
target=${1:-/tmp/site_fk}
die() { echo "flashkda_build: $*" >&2; exit 1; }

for f in flashkda.tgz cutlass.tgz; do
  [ -f "$src/$f" ] || die "missing $src/$f (the FlashKDA and CUTLASS source tarballs)"
done

# The CUDA toolkit: torch's extension builder takes headers and nvcc from CUDA_HOME. An `nvcc` on PATH may be
# a wrapper script (/usr/local/bin/nvcc), so a candidate must hold both bin/nvcc and include/cuda.h.
if [ -z "${CUDA_HOME:-}" ]; then
  candidates=("${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*)
  if nvcc_path=$(command -v nvcc 2>/dev/null); then
    candidates+=("$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")")
  fi
  for c in "${candidates[@]}"; do
    if [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda.h" ]; then CUDA_HOME=$c; break; fi
  done
fi
[ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] \
  || die "no CUDA toolkit found (nvcc): set CUDA_HOME to a toolkit holding bin/nvcc and include/cuda.h"
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"

if PYTHONPATH="$target" python3 -c "import torch, flash_kda" 2>/dev/null; then
  echo "flashkda_build: $target already has an importable flash_kda; not rebuilt"
  exit 0
fi

commit=$(python3 -c "import tarfile, sys; print(tarfile.open(sys.argv[1]).pax_headers.get('comment', '')[:7])" \
         "$src/flashkda.tgz")
work=$(mktemp -d /tmp/flashkda_build.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src/cutlass" "$work/bin"
tar -xzf "$src/flashkda.tgz" -C "$work/src"
tar -xzf "$src/cutlass.tgz" -C "$work/src/cutlass"
# setup.py runs `git submodule update --init cutlass` (its result unchecked) and `git rev-parse` (inside a
# try). The unpacked tree is no git repository, and git may be missing: a `git` on PATH that accepts the
# submodule call as done (CUTLASS is already in place) and fails anything else leaves setup.py unchanged.
cat > "$work/bin/git" <<'EOF'
#!/bin/sh
[ "$1" = submodule ] && exit 0
exit 1
EOF
chmod +x "$work/bin/git"

echo "flashkda_build: FlashKDA ${commit:-?} for sm_${FLASH_KDA_CUDA_ARCHS:-90a} with $CUDA_HOME/bin/nvcc into $target"
start=$(date +%s)
log=${OUT:-/tmp}/flashkda_build.log
mkdir -p "$(dirname "$log")"
if ! (cd "$work/src" && PATH="$work/bin:$PATH" FLASH_KDA_CUDA_ARCHS="${FLASH_KDA_CUDA_ARCHS:-90a}" \
      NVCC_THREADS="${NVCC_THREADS:-16}" MAX_JOBS="${MAX_JOBS:-16}" FLASH_KDA_VERSION_SUFFIX="+${commit:-src}" \
      python3 -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir --upgrade \
        --target "$target" . ) > "$log" 2>&1; then
  tail -n 40 "$log" >&2
  die "build failed after $(( $(date +%s) - start )) s (full log: $log)"
fi
PYTHONPATH="$target" python3 -c "import torch, flash_kda; print('flashkda_build: import flash_kda OK from', flash_kda.__file__)" \
  || die "built, but flash_kda does not import from $target"
echo "flashkda_build: built in $(( $(date +%s) - start )) s (log: $log)"
