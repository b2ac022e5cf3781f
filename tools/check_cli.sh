#!/usr/bin/env bash
# ctest cli.subcommands: every subcommand of sparse-attn on a small case, checking what it prints,
# its exit codes, and the files it writes (PNGs, safetensors, JSON lines).
set -uo pipefail
CLI=${SPARSE_ATTN_CLI:?set SPARSE_ATTN_CLI to the sparse-attn binary}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}
# expect NAME CODE PATTERN... -- ARGS: runs the CLI, checks the exit code and that the combined
# output matches every pattern (extended regex).
expect() {
  local name=$1 code=$2
  shift 2
  local patterns=()
  while [ "$1" != "--" ]; do
    patterns+=("$1")
    shift
  done
  shift
  local out rc
  out=$("$CLI" "$@" 2>&1)
  rc=$?
  echo "== $name: sparse-attn $* (exit $rc)"
  [ "$rc" -eq "$code" ] || fail "$name: exit code $rc, expected $code"$'\n'"$out"
  for p in "${patterns[@]}"; do
    grep -Eq -- "$p" <<<"$out" || fail "$name: output lacks /$p/"$'\n'"$out"
  done
}
is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; }

# Interface: help with defaults on every subcommand, sizes with suffixes, errors naming the flag.
expect help 0 "demo" "verify" "bench" -- --help
# (Patterns allow for CLI11 versions that format defaults differently: "=4k" or "[4k]".)
expect demo-help 0 "--seq-len" "--topk .*512" "--threshold .*0.9" "--plot" \
  "--sinks .*4" "--mode .*structured,random.*structured" -- demo --help
expect verify-help 0 "--op" "--seq-len .*4k" "--backend .*native,reference,tilelang.*native" -- verify --help
expect bench-help 0 "--cases" "--json" "--reps" -- bench --help
expect bad-size 2 "--seq-len" "expected a size such as 4096, 32k or 1m, got '12q'" -- demo --seq-len 12q
expect bad-method 2 "--method" -- demo --method dense
expect bad-device 2 "--device" "expected auto, cpu, cuda or cuda:N" -- demo --device tpu
# Only meaningful where there is no GPU (CI); on the GPU machine the GPU suite covers cuda.
if ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
  expect no-gpu 2 "--device cuda" "no usable GPU" -- demo --device cuda --seq-len 1k
fi
expect missing-file 2 "$TMP/none.npy: no such file" -- \
  demo --q "$TMP/none.npy" --k "$TMP/none.npy" --v "$TMP/none.npy"
expect partial-files 2 "--q, --k and --v" -- demo --q "$TMP/x.npy"

# demo: both methods on a small structured workload; metrics, times, plots, saved tensors (the
# CPU backend runs every op natively, QSA's selection as one fused op).
expect demo 0 "on cpu" "QSA" "XAttention" "density \(selected / visible\) +[0-9.]+ %" \
  "attention-mass recall +[0-9.]+ %" "output relative error vs dense +[0-9.e+-]+" \
  "needle hit rate +[0-9.]+ %" "indexer select: scores, top-k, tokens \(native\)" "sparse attention \(native\)" \
  "estimate \+ select \(native\)" "block-sparse attention \(native\)" \
  "dense attention \([0-9]+ evaluated rows" "sampled; --rows all evaluates every row" \
  "wrote $TMP/sel-qsa.png" "wrote $TMP/sel-xattn.png" -- \
  demo --device cpu --seq-len 1k --rows 16 --needles 2 --plot "$TMP/sel.png" \
  --save-workload "$TMP/w.safetensors"
is_png "$TMP/sel-qsa.png" || fail "demo: $TMP/sel-qsa.png is not a PNG"
is_png "$TMP/sel-xattn.png" || fail "demo: $TMP/sel-xattn.png is not a PNG"

# Threshold 1 keeps every causal block: XAttention must then equal dense attention.
expect xattn-exact 0 "density \(selected / visible\) +100.00 %" "attention-mass recall +100.00 %" \
  "output relative error vs dense +[0-9.]+e-0[3-9]" -- \
  demo --method xattn --seq-len 512 --rows all --threshold 1
# A prefill chunk (the last 256 of 1k tokens) for two requests; a chunk longer than the context.
expect chunk 0 "batch 2, 1k keys, 256 query rows" "metrics on [0-9]+ of 512 query rows" -- \
  demo --seq-len 1k --q-len 256 --batch 2 --rows 8 --needles 2
expect chunk-too-long 2 "--q-len: expected at most --seq-len \(1024\), got 2048" -- \
  demo --seq-len 1k --q-len 2k
# Metrics as JSON lines.
expect demo-json 0 "QSA" -- demo --method qsa --seq-len 1k --rows 8 --json "$TMP/d.jsonl"
grep -q '"method":"QSA"' "$TMP/d.jsonl" && grep -q '"recall":' "$TMP/d.jsonl" ||
  fail "demo --json: JSON line missing or incomplete: $(cat "$TMP/d.jsonl" 2>/dev/null)"
# The random mode has no needles.
expect random 0 "random workload" "needle hit rate +n/a" -- \
  demo --method qsa --mode random --seq-len 1k --rows 8

# demo on users' tensors (the saved workload), and a mismatched file named in the error.
W="$TMP/w-qsa.safetensors"
expect files 0 "tensors from $W:q" "QSA" "needle hit rate +n/a" -- \
  demo --method qsa --rows 8 --q "$W:q" --k "$W:k" --v "$W:v" --index-q "$W:index_q" --index-k "$W:index_k"
expect files-mismatch 2 "$TMP/w-xattn.safetensors:k: the query's head dim \(shape\[3\]\) must be 256, got 128" -- \
  demo --method qsa --q "$W:q" --k "$TMP/w-xattn.safetensors:k" --v "$TMP/w-xattn.safetensors:v"

# verify: reference against itself passes; so does native on the CPU (the CPU backend).
expect verify-ref 0 "qsa_indexer_mqa_score" "qsa_sparse_attention" "xattn_estimate" \
  "block_sparse_attention" "xattention_prefill" "result: all outputs match the reference" -- \
  verify --backend reference --device cpu --seq-len 512 --q-len 64 --topk 16
expect verify-native 0 "qsa_indexer_mqa_score" "qsa_sparse_attention" "xattn_estimate" \
  "block_sparse_attention" "xattention_prefill" "result: all outputs match the reference" -- \
  verify --device cpu --seq-len 512 --q-len 64 --topk 16
expect verify-bad-qlen 2 "--q-len" -- verify --device cpu --seq-len 512 --q-len 1k

# bench: the case list, one small case with a JSON line.
expect bench-list 0 "cpu/indexer-prefill/2k" "sparse-decode/b32/ctx32k" -- bench --cases list
expect bench 0 "cpu/indexer-prefill/2k +native" "TFLOP/s" "floor/time" -- \
  bench --device cpu --cases cpu/indexer-prefill --warmup 0 --json "$TMP/b.jsonl"
grep -q '"case":"cpu/indexer-prefill/2k"' "$TMP/b.jsonl" && grep -q '"floor_over_time"' "$TMP/b.jsonl" ||
  fail "bench: JSON line missing or incomplete: $(cat "$TMP/b.jsonl" 2>/dev/null)"
expect bench-bad-case 2 "--cases: 'nothing' matches no case" -- bench --device cpu --cases nothing

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all CLI checks passed"
