#!/usr/bin/env bash
# Run the transformers integration tests on transformers 5.17.0 and on the newest release, each in a
# venv of its own (which sees this interpreter's packages: numpy, torch, pytest, ...).
#
#   scripts/hf_versions.sh [VENV_DIR]        # default: ~/.cache/kvcanary-cupy/hf-venvs
#   HF_NEWEST=5.25.0 scripts/hf_versions.sh  # pin "newest" instead of asking the registry
#
# A release whose pip resolution fails on a dependency this machine lacks is installed with
# --no-deps, then its other requirements (transformers' hard dependency on the `kernels` package
# since 5.25 is one such: continuous batching imports without it); the script says so.
# Prints one line per version and exits non-zero when a version's tests fail.
set -u -o pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venvs="${1:-$HOME/.cache/kvcanary-cupy/hf-venvs}"
python="${PYTHON:-python}"
mkdir -p "$venvs"

newest="${HF_NEWEST:-}"
if [ -z "$newest" ]; then
  newest="$("$python" -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')"
fi
if [ -z "$newest" ]; then
  echo "hf_versions: cannot learn the newest transformers release (pip index versions); set HF_NEWEST" >&2
  exit 2
fi

status=0
for version in 5.17.0 "$newest"; do
  venv="$venvs/transformers-$version"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv --system-site-packages "$venv" || exit 2
  fi
  how="pip"
  if ! "$venv/bin/python" -c "import transformers, sys; sys.exit(transformers.__version__ != '$version')" 2>/dev/null; then
    if ! "$venv/bin/python" -m pip install -q "transformers==$version" psutil >"$venv/install.log" 2>&1; then
      missing="$(grep -m1 -o 'No matching distribution found for [^ ]*' "$venv/install.log" | sed 's/.* for //')"
      name="$(printf '%s' "$missing" | sed 's/[<>=!~;[].*//')"
      if [ -z "$name" ] || ! "$venv/bin/python" -m pip install -q --no-deps "transformers==$version" >>"$venv/install.log" 2>&1; then
        echo "transformers $version: install failed (see $venv/install.log)"; status=1; continue
      fi
      "$venv/bin/python" - "$name" >"$venv/requirements.txt" <<'PY'
import importlib.metadata, sys
skip = sys.argv[1].lower().replace("_", "-")
for r in importlib.metadata.requires("transformers") or ():
    req = r.split(";")[0].strip()
    if "extra ==" in r or req.lower().replace("_", "-").startswith(skip):
        continue
    print(req)
print("psutil")
PY
      if ! "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" >>"$venv/install.log" 2>&1; then
        echo "transformers $version: its requirements failed to install (see $venv/install.log)"; status=1; continue
      fi
      how="pip --no-deps without $missing, which no index here has"
    fi
  fi
  if ! "$venv/bin/python" -c "import transformers.generation.continuous_batching" >>"$venv/install.log" 2>&1; then
    echo "transformers $version: does not import (see $venv/install.log)"; status=1; continue
  fi
  start=$SECONDS
  if (cd "$here" && "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_transformers_integration.py \
        tests/test_transformers_threads.py >"$venv/pytest.log" 2>&1); then
    result="passed"
  else
    result="FAILED"; status=1
  fi
  echo "transformers $version ($how): $(tail -n 1 "$venv/pytest.log") -> $result in $((SECONDS - start)) s (log: $venv/pytest.log)"
done
exit $status
