#!/usr/bin/env bash
# Runs the Python client's tests against a real `engram up` (started by the tests
# themselves, with a temp home and free ports). Needs python3 (3.10 or newer) and a
# reachable PyPI; builds target/debug/engram first if it is missing.
#
#   clients/python/run-tests.sh            # every test
#   clients/python/run-tests.sh -k mem0    # pytest's own arguments
#
# The venv lives in $ENGRAM_PY_VENV (default ~/.cache/engram/py-client-venv) and is reused;
# the package is reinstalled from this folder on every run, as `pip install` would.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${ENGRAM_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/engram/py-client-venv}"
python="${PYTHON:-python3}"

if ! "$venv/bin/python" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$here[test,nats]"
# Same version number, new code: reinstall the package itself (not its dependencies).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$here"

export ENGRAM_BIN="${ENGRAM_BIN:-$repo/target/debug/engram}"
if [ ! -x "$ENGRAM_BIN" ]; then
  (cd "$repo" && cargo build -p engram)
fi

# From the tests' folder's parent, so `tests` imports as a package and the installed
# engram_client (not the source tree) is what runs.
cd "$here"
exec "$venv/bin/python" -m pytest tests -q -p no:cacheprovider "$@"
