#!/usr/bin/env bash
# spardist launcher.
#   ./run_mpi.sh                      the main job on the embedded default
#   ./run_mpi.sh --test [PYTEST ARGS] the whole test suite
#   ./run_mpi.sh [-n NP] [--ranks-per-node R] [--hostfile F] [--dry-run] MODULE [ARGS...]
# First use creates .venv and installs spardist with its test extras. If no working mpiexec is on
# PATH, the mpich wheel from PyPI is installed into .venv; SPARDIST_MPI=system builds mpi4py
# against the site's mpicc instead (HPC sites). Later runs reuse .venv (re-installed when
# pyproject.toml changes).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${SPARDIST_VENV:-$ROOT/.venv}"
STAMP="$VENV/.spardist-installed"
MPI_MODE="${SPARDIST_MPI:-auto}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

die() { echo "run_mpi.sh: $*" >&2; exit 1; }

find_python() {
  local c
  for c in ${SPARDIST_PYTHON:-} python3.13 python3.12 python3.11 python3.10 python3 python; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

have_working_mpiexec() {
  command -v mpiexec >/dev/null 2>&1 || return 1
  timeout 60 mpiexec -n 1 true >/dev/null 2>&1
}

bootstrap() {
  local want py
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) mpi=$MPI_MODE"
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  py="$(find_python)" || die "needs Python >= 3.10 on PATH (or SPARDIST_PYTHON=/path/to/python3)"
  echo "run_mpi.sh: setting up $VENV with $("$py" --version 2>&1) (first use, ~1 min) ..." >&2
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV" || die "python -m venv failed; install the venv module (Debian: apt-get install python3-venv)"
  local pip=("$VENV/bin/python" -m pip install -q)
  case "$MPI_MODE" in
    system)
      command -v mpicc >/dev/null 2>&1 || die "SPARDIST_MPI=system needs the site's mpicc on PATH (e.g. module load openmpi)"
      MPICC="$(command -v mpicc)" "${pip[@]}" --no-binary mpi4py --no-cache-dir "mpi4py>=4" ;;
    auto)
      if [ -x "$VENV/bin/mpiexec" ] || ! have_working_mpiexec; then
        echo "run_mpi.sh: no working mpiexec on PATH: installing the mpich wheel into .venv" >&2
        "${pip[@]}" mpich
      fi ;;
    wheel) "${pip[@]}" mpich ;;
    *) die "SPARDIST_MPI must be auto, wheel or system (got '$MPI_MODE')" ;;
  esac
  "${pip[@]}" -e "$ROOT[test]" || die "installing spardist into $VENV failed (see pip's message above)"
  echo "$want" > "$STAMP"
}

bootstrap
cd "$ROOT"
exec "$VENV/bin/python" -m substrate.launch "$@"
