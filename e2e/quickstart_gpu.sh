#!/usr/bin/env bash
# docs/quickstart.md section 3, command for command, on the GPU cluster of the current kube
# context: build and push both images to $SHOAL_E2E_REGISTRY, install the chart watching
# `serving`, serve examples/gpu-qwen.yaml from that registry, wait for Ready, chat with the
# API key, clean up. tests/packaging/test_docs_commands.py checks that every cluster command
# of the quickstart appears here verbatim.
#
# Needs docker, kubectl, helm, curl, a reachable cluster with nvidia.com/gpu nodes and
# SHOAL_E2E_REGISTRY (a registry the nodes pull from); without them it prints SKIP, exits 0.
set -euo pipefail
cd "${BASH_SOURCE[0]%/*}/.."

for tool in docker kubectl helm curl python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "SKIP: $tool not found"; exit 0; }
done
[ -n "${SHOAL_E2E_REGISTRY:-}" ] || { echo "SKIP: SHOAL_E2E_REGISTRY is not set"; exit 0; }
kubectl cluster-info >/dev/null 2>&1 || { echo "SKIP: no reachable cluster"; exit 0; }
gpus=$(kubectl get nodes -o jsonpath='{.items[*].status.allocatable.nvidia\.com/gpu}')
[ -n "${gpus// /}" ] || { echo "SKIP: no node has nvidia.com/gpu"; exit 0; }

# It installs and later removes release `shoal` and namespace `serving`: never someone else's.
if helm status shoal --namespace shoal-system >/dev/null 2>&1 || kubectl get namespace serving >/dev/null 2>&1; then
  echo "FAIL: release shoal or namespace serving exists already; use a scratch cluster"; exit 1
fi

export REGISTRY="$SHOAL_E2E_REGISTRY"
forward_pid=""
cleanup() {
  [ -n "$forward_pid" ] && kill "$forward_pid" 2>/dev/null || true
  sed "s#ghcr.io/shoal-dev#$REGISTRY#" examples/gpu-qwen.yaml | kubectl delete -n serving --ignore-not-found -f - || true
  helm uninstall shoal --namespace shoal-system 2>/dev/null || true
  kubectl delete namespace serving --ignore-not-found || true
}
trap cleanup EXIT

docker build -f Dockerfile.runtime -t $REGISTRY/shoal-runtime:0.1.0 .
docker build -f Dockerfile.operator -t $REGISTRY/shoal-operator:0.1.0 .
docker push $REGISTRY/shoal-runtime:0.1.0
docker push $REGISTRY/shoal-operator:0.1.0

kubectl create namespace serving
helm install shoal charts/shoal --namespace shoal-system --create-namespace --set image.repository=$REGISTRY/shoal-operator --set 'watchNamespaces={serving}' --set dashboard.enabled=true --set networkPolicy.enabled=true
kubectl rollout status deployment/shoal --namespace shoal-system --timeout=300s

sed "s#ghcr.io/shoal-dev#$REGISTRY#" examples/gpu-qwen.yaml | kubectl apply -n serving -f -
timeout 60 kubectl get inferenceservices -n serving --watch || true
kubectl wait -n serving --for=jsonpath='{.status.phase}'=Ready inferenceservice/qwen3-8b --timeout=3600s
kubectl get inferenceservices -n serving

kubectl port-forward -n serving svc/qwen3-8b 8080:80 &
forward_pid=$!
for _ in $(seq 1 30); do
  curl -s -o /dev/null http://127.0.0.1:8080/ready && break
  sleep 1
done
curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Authorization: Bearer change-me' -H 'Content-Type: application/json' -d '{"model": "qwen3-8b", "messages": [{"role": "user", "content": "Why is my device blinking amber?"}], "max_tokens": 64}' \
  | python3 -c 'import json, sys; body = json.load(sys.stdin); print(body["choices"][0]["message"]["content"])'
echo "PASS: quickstart on the GPU cluster"
