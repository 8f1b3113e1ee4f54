# The two commands a new user runs: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs on first use (torch==2.13.0 first, so that
# nothing else pulls a different torch), then reuses it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkmeta-installed

.PHONY: demo test test-gpu bench clean test-triton-compat

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m chunkmeta

test: $(STAMP)
	$(PY) -m pytest

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

# The kernel compiles for sm_90 with the Triton that torch 2.11 engines ship (3.6), not only with
# the newest one .venv gets: Triton's compiler accepts different shapes in different versions.
# The CUDA C fill compiles with the NVRTC of CUDA 13.0 (what torch 2.11's CUDA 13.0 build, the
# one engines run, depends on; the venv's own torch is the CPU build, which needs none).
# CI runs it after `make test`. Its own venv; `rm -rf .venv-triton-3.6.0` to rebuild.
TRITON_COMPAT ?= 3.6.0
NVRTC_COMPAT ?= 13.0.88
COMPAT_VENV := .venv-triton-$(TRITON_COMPAT)
COMPAT_STAMP := $(COMPAT_VENV)/.installed

# Triton goes in with --no-deps: it must stay at TRITON_COMPAT whatever torch's wheel declares.
$(COMPAT_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(COMPAT_VENV)/bin/python -m pip install --quiet --no-deps triton==$(TRITON_COMPAT)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --no-deps nvidia-cuda-nvrtc==$(NVRTC_COMPAT)
	$(COMPAT_VENV)/bin/python -m pip install --quiet torch==2.13.0 numpy attrs pytest
	$(COMPAT_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(COMPAT_VENV)/bin/python -c "import triton; assert triton.__version__ == '$(TRITON_COMPAT)', triton.__version__"
	$(COMPAT_VENV)/bin/python -c "from chunkmeta.fill import cuda_fill; v = cuda_fill.nvrtc_version(); assert v == '$(basename $(NVRTC_COMPAT))', v"
	touch $(COMPAT_STAMP)

# CHUNKMETA_REQUIRE_SM90_COMPILE: a Triton that cannot compile for sm_90 here fails, not skips
test-triton-compat: $(COMPAT_STAMP)
	CHUNKMETA_REQUIRE_SM90_COMPILE=1 $(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider -o addopts="-ra" \
		tests/kernels/test_kernel_compiles.py

# Opt-in: the SGLang adapter against a real SGLang (CPU). Its own venv, .venv-sglang: SGLang's
# wheel without its dependencies (it pins another torch), then the pure-Python/CPU packages its
# backend modules import, every pip line pinned to torch==2.13.0 so nothing pulls another torch.
# Never torchvision: tests/integrations/sglang/sglang_cpu_stubs.py stands in for it. `rm -rf .venv-sglang` to rebuild.
.PHONY: test-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.sglang-$(SGLANG_VERSION)-installed
TORCH_PIN := torch==2.13.0

$(SGLANG_STAMP): pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN)
	rm -rf $(SGLANG_VENV)/wheels
	$(SGLANG_PY) -m pip download --quiet --no-deps -d $(SGLANG_VENV)/wheels sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) -m pip install --quiet --no-deps $(SGLANG_VENV)/wheels/sglang-*.whl
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN) numpy orjson psutil pybase64 requests packaging pillow \
		starlette msgspec pydantic pyzmq tqdm IPython aiohttp dill einops gguf partial_json_parser uvicorn \
		fastapi triton transformers==5.19.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 \
		compressed-tensors==0.18.0 openai==2.8.0
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN) pytest attrs -e .
	$(SGLANG_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -p no:cacheprovider -o addopts="-ra" tests/integrations/sglang/test_sglang_real.py tests/integrations/sglang/test_sglang.py

# Opt-in: the vLLM adapter against the real vLLM (CPU, VLLM_TARGET_DEVICE=cpu). Its own venv,
# .venv-vllm. Every install is --no-deps with torch==2.13.0 named explicitly: vLLM 0.33.0 pins
# torch==2.14.0 and CUDA wheels, which a resolving install would download (gigabytes). The vLLM
# wheel (336 MB) is downloaded once into VLLM_WHEEL_DIR. The suite's addopts name
# pytest-benchmark's flag, which this venv leaves out. `rm -rf .venv-vllm` to rebuild.
.PHONY: test-vllm
VLLM_VERSION ?= 0.33.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.vllm-$(VLLM_VERSION)-installed
VLLM_WHEEL_DIR ?= $(VLLM_VENV)/wheels
VLLM_PIP := $(VLLM_PY) -m pip install --quiet --no-deps torch==2.13.0
# torch's requirements; the pure-Python/CPU packages vLLM's config, attention-backend and model
# modules import (pinned where vLLM pins them); pytest's.
VLLM_DEPS := filelock fsspec jinja2 MarkupSafe networkx sympy mpmath typing-extensions setuptools \
	packaging regex requests urllib3 idna certifi charset-normalizer numpy psutil pyzmq \
	pydantic pydantic-core typing-inspection annotated-types cbor2 \
	transformers==5.20.2 huggingface_hub tqdm httpx2 httpcore2 truststore h11 pyyaml \
	safetensors tokenizers aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
	oss-harmony==0.0.11 openai sniffio anyio pillow pybase64 cachetools msgspec cloudpickle uvloop \
	py-cpuinfo prometheus_client xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.3 \
	starlette annotated-doc partial-json-parser llguidance==1.7.6 \
	einops compressed-tensors==0.17.0 loguru \
	pytest pluggy iniconfig pygments

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) $(VLLM_DEPS)
	ls $(VLLM_WHEEL_DIR)/vllm-$(VLLM_VERSION)-*.whl >/dev/null 2>&1 || \
		$(VLLM_PY) -m pip download --quiet --no-deps -d $(VLLM_WHEEL_DIR) vllm==$(VLLM_VERSION)
	$(VLLM_PIP) $(VLLM_WHEEL_DIR)/vllm-$(VLLM_VERSION)-*.whl
	$(VLLM_PIP) -e .
	$(VLLM_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -p no:cacheprovider -o addopts="-ra" \
		tests/integrations/vllm/test_vllm_real.py

clean:
	rm -rf $(VENV) .venv-triton-* .pytest_cache .hypothesis .benchmarks *.egg-info
