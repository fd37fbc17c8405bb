#!/usr/bin/env bash
# One streamed-chat run of guidellm or of aiperf against a fresh `packserve serve` (default
# catalog), printed beside packserve's own /v1/metrics/summary for the same requests: p50 time to
# first token and inter-token latency as the tool measured them and as packserve did, and (aiperf)
# goodput at packserve's chat SLO (4 s to the first token) as aiperf computes it and as packserve
# does. Needs scripts/setup.sh --dev (.venv-clients). A few minutes for guidellm's default run;
# aiperf's own services take about a core, which on 2 cores slows the runner's decoding many
# times over (docs/clients.md), so give it few requests there.
#   scripts/client_metrics.sh guidellm|aiperf [REQUESTS] [OUTPUT_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
tool=${1:?usage: scripts/client_metrics.sh guidellm|aiperf [REQUESTS] [OUTPUT_TOKENS]}
requests=${2:-40}
tokens=${3:-64}
port=${PACKSERVE_PORT:-8017}
url=http://127.0.0.1:$port
chat=smollm2-135m-instruct
work=$(mktemp -d "${TMPDIR:-/tmp}/packserve-client-metrics.XXXXXX")
trap 'kill "$server" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
.venv/bin/python scripts/client_tokenizer.py "$work/tokenizer" "$chat" >/dev/null

start() {  # a fresh server, the chat model loaded by one request sent whole (no stream)
  .venv/bin/packserve serve --port "$port" >"$work/serve-$1.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do curl -sf "$url/readyz" >/dev/null && break; sleep 0.5; done
  curl -sf "$url/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$chat\", \"max_tokens\": 4, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}" >/dev/null
}
stop() { kill "$server"; wait "$server" 2>/dev/null || true; }
summary() { curl -sf "$url/v1/metrics/summary" >"$work/$1-summary.json"; }

start "$tool"
if [ "$tool" = guidellm ]; then
HF_HUB_OFFLINE=1 .venv-clients/bin/guidellm run \
  --backend "kind=openai_http,target=$url,model=$chat" --profile kind=synchronous \
  --constraint "kind=max_requests,count=$requests" \
  --data "kind=synthetic_text,prompt_tokens=64,output_tokens=$tokens" \
  --tokenizer "kind=huggingface_auto,model=$work/tokenizer" \
  --output "kind=json,path=$work/guidellm.json" --disable-progress >"$work/guidellm.log" 2>&1
else
.venv-clients/bin/aiperf profile --model "$chat" --url "$url" --endpoint-type chat --streaming \
  --tokenizer "$work/tokenizer" --request-count "$requests" --concurrency 1 --request-rate 20 \
  --isl 64 \
  --osl "$tokens" --extra-inputs ignore_eos:true --extra-inputs "min_tokens:$tokens" \
  --goodput time_to_first_token:4000 --artifact-dir "$work/aiperf" --ui none \
  >"$work/aiperf.log" 2>&1
fi
summary "$tool"
stop

.venv/bin/python - "$work" "$chat" "$tool" <<'EOF'
import json, sys
from pathlib import Path

work, chat, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def ours(tool):
    rows = json.loads((work / f"{tool}-summary.json").read_text())["latency"]["by_model"]
    row = next(r for r in rows if r["model"] == chat)
    return (row["time_to_first_token"]["p50_seconds"] * 1000,
            row["inter_token"]["p50_seconds"] * 1000, row["goodput_rps"],
            row["time_to_first_token"]["count"])

if name == "guidellm":
    bench = json.loads((work / "guidellm.json").read_text())["benchmarks"][0]["metrics"]
    tool = (bench["time_to_first_token_ms"]["successful"]["median"],
            bench["inter_token_latency_ms"]["successful"]["median"], None)
else:
    a = json.loads((work / "aiperf" / "profile_export_aiperf.json").read_text())
    tool = (a["time_to_first_token"]["p50"], a["inter_token_latency"]["p50"],
            (a.get("goodput") or {}).get("avg"))
print("| run | p50 TTFT, tool / packserve (ms) | p50 ITL, tool / packserve (ms) | goodput, tool / packserve (req/s) | streams packserve counted |")
print("|---|---:|---:|---:|---:|")
t, i, good, n = ours(name)
gp = "n/a" if tool[2] is None else f"{tool[2]:.3f}"
print(f"| {name} | {tool[0]:.1f} / {t:.1f} | {tool[1]:.2f} / {i:.2f} | {gp} / {good:.3f} | {n} |")
EOF
