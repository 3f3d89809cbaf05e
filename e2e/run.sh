#!/usr/bin/env bash
# End-to-end test of the operator on a real cluster.
#
#   e2e/run.sh                # kind: create cluster "shoal-e2e" if missing, build + load images
#   SHOAL_E2E_CLUSTER=current e2e/run.sh   # the current kubeconfig context, images from a registry:
#       SHOAL_OPERATOR_IMAGE=registry/shoal-operator:tag SHOAL_RUNTIME_IMAGE=registry/shoal-runtime:cpu
#
# Then: helm install charts/shoal, apply examples/cpu-demo.yaml, wait for Ready, one chat request
# through the router Service, and `kubectl get inferenceservices` must show the columns
# (e2e/test_cluster.py). SHOAL_E2E_KEEP=1 leaves everything installed.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER_MODE="${SHOAL_E2E_CLUSTER:-kind}"
KIND_NAME="${SHOAL_E2E_KIND_NAME:-shoal-e2e}"
PYTHON="${PYTHON:-.venv/bin/python}"

if [[ "$CLUSTER_MODE" == "kind" ]]; then
  for tool in kind docker kubectl helm; do
    command -v "$tool" >/dev/null || { echo "e2e/run.sh: '$tool' not found on PATH" >&2; exit 2; }
  done
  if ! kind get clusters | grep -qx "$KIND_NAME"; then
    kind create cluster --name "$KIND_NAME" --wait 120s
  fi
  kubectl config use-context "kind-$KIND_NAME"
  export SHOAL_OPERATOR_IMAGE="${SHOAL_OPERATOR_IMAGE:-shoal-operator:e2e}"
  export SHOAL_RUNTIME_IMAGE="${SHOAL_RUNTIME_IMAGE:-shoal-runtime:e2e-cpu}"
  docker build -f Dockerfile.operator -t "$SHOAL_OPERATOR_IMAGE" .
  docker build -f Dockerfile.runtime --build-arg VARIANT=cpu -t "$SHOAL_RUNTIME_IMAGE" .
  kind load docker-image --name "$KIND_NAME" "$SHOAL_OPERATOR_IMAGE" "$SHOAL_RUNTIME_IMAGE"
fi

exec "$PYTHON" -m pytest e2e -m cluster -v -p no:cacheprovider "$@"
