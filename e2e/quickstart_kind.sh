#!/usr/bin/env bash
# docs/quickstart.md section 2 and the README's Kubernetes path, command for command, on a
# fresh kind cluster: build and load both images, install the chart, serve the CPU demo, wait
# for 2/2 Ready, chat through the router, clean up. tests/packaging/test_docs_commands.py
# checks that every cluster command of those docs appears here verbatim.
#
# Needs docker (with a daemon), kind, kubectl, helm and curl; without them it prints SKIP and
# exits 0. KEEP_CLUSTER=1 leaves the cluster up for a look around.
set -euo pipefail
cd "${BASH_SOURCE[0]%/*}/.."

for tool in docker kind kubectl helm curl python3; do
  command -v "$tool" >/dev/null 2>&1 || { echo "SKIP: $tool not found"; exit 0; }
done
docker info >/dev/null 2>&1 || { echo "SKIP: no docker daemon"; exit 0; }
if kind get clusters 2>/dev/null | grep -qx shoal; then
  echo "FAIL: a kind cluster named shoal exists already; delete it or run elsewhere"; exit 1
fi

forward_pid=""
cleanup() {
  [ -n "$forward_pid" ] && kill "$forward_pid" 2>/dev/null || true
  if [ "${KEEP_CLUSTER:-0}" != 1 ] && kind get clusters 2>/dev/null | grep -qx shoal; then
    kind delete cluster --name shoal
  fi
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "cluster and images"
kind create cluster --name shoal
docker build -f Dockerfile.runtime --build-arg VARIANT=cpu -t ghcr.io/shoal-dev/shoal-runtime:0.1.0-cpu .
docker build -f Dockerfile.operator -t ghcr.io/shoal-dev/shoal-operator:0.1.0 .
kind load docker-image ghcr.io/shoal-dev/shoal-runtime:0.1.0-cpu ghcr.io/shoal-dev/shoal-operator:0.1.0 --name shoal

step "operator and demo service"
helm install shoal charts/shoal --namespace shoal-system --create-namespace
kubectl rollout status deployment/shoal --namespace shoal-system --timeout=300s
kubectl apply -f examples/cpu-demo.yaml
# The docs watch; here the watch runs for a while (it never ends by itself), then we wait.
timeout 30 kubectl get inferenceservices --watch || true
kubectl wait --for=jsonpath='{.status.phase}'=Ready inferenceservice/demo --timeout=900s
kubectl get inferenceservices
ready=$(kubectl get inferenceservice demo -o jsonpath='{.status.ready}')
[ "$ready" = "2/2" ] || { echo "FAIL: ready is $ready, want 2/2"; exit 1; }
kubectl describe inferenceservice demo
kubectl get pods -l serving.shoal.dev/inference-service=demo

step "a chat completion through the router"
kubectl port-forward svc/demo 8080:80 &
forward_pid=$!
for _ in $(seq 1 30); do
  curl -s -o /dev/null http://127.0.0.1:8080/ready && break
  sleep 1
done
curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "shoal-demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}' \
  | python3 -c 'import json, sys; body = json.load(sys.stdin); assert body["choices"][0]["message"]["content"] is not None, body; print("ok:", body["usage"])'
kill "$forward_pid"; forward_pid=""

step "clean up"
kubectl delete -f examples/cpu-demo.yaml
helm uninstall shoal --namespace shoal-system
if [ "${KEEP_CLUSTER:-0}" != 1 ]; then
  kind delete cluster --name shoal
fi
echo "PASS: quickstart on kind"
