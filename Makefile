# The two commands a new user runs: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs on first use (torch==2.13.0 first, so that
# nothing else pulls a different torch), then reuses it.

PYTHON ?= python3
TORCH_PIN := torch==2.13.0

# Every venv here is built in two steps. The heavy one (torch, an engine, their dependencies) is
# stamped with a hash of the pins it installs: changing a pin rebuilds that venv, and nothing else
# does. Only the cheap install of chunkmeta itself (editable) follows pyproject.toml.
pins_hash = $(shell printf '%s' '$(strip $(1))' | sha1sum | cut -c1-12)

VENV := .venv
PY := $(VENV)/bin/python
VENV_DEPS := $(VENV)/.deps-$(call pins_hash,$(TORCH_PIN))
STAMP := $(VENV)/.chunkmeta-installed
LINT_PATHS := chunkmeta integrations tests bench conftest.py

.PHONY: demo test lint test-gpu clean test-triton-compat test-wheel format-c

$(VENV_DEPS):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	touch $@

# the test extra (pytest, hypothesis, fla-core, triton, ruff) is declared in pyproject.toml
$(STAMP): $(VENV_DEPS) pyproject.toml
	$(PY) -m pip install --quiet $(TORCH_PIN) -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) -m chunkmeta

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) bench/results.py render --check  # bench/RESULTS.md and the docs/ pictures are what the data file draws

test: lint
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
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PKGS := numpy attrs pytest
COMPAT_DEPS := $(COMPAT_VENV)/.deps-$(call pins_hash,$(TORCH_PIN) $(TRITON_COMPAT) $(NVRTC_COMPAT) $(COMPAT_PKGS))
COMPAT_STAMP := $(COMPAT_VENV)/.chunkmeta-installed

# Triton goes in with --no-deps: it must stay at TRITON_COMPAT whatever torch's wheel declares.
$(COMPAT_DEPS):
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet $(TORCH_PIN)
	$(COMPAT_PY) -m pip install --quiet --no-deps triton==$(TRITON_COMPAT)
	$(COMPAT_PY) -m pip install --quiet --no-deps nvidia-cuda-nvrtc==$(NVRTC_COMPAT)
	$(COMPAT_PY) -m pip install --quiet $(TORCH_PIN) $(COMPAT_PKGS)
	$(COMPAT_PY) -c "import triton; assert triton.__version__ == '$(TRITON_COMPAT)', triton.__version__"
	touch $@

$(COMPAT_STAMP): $(COMPAT_DEPS) pyproject.toml
	$(COMPAT_PY) -m pip install --quiet --no-deps -e .
	$(COMPAT_PY) -c "from chunkmeta.fill import cuda_fill; v = cuda_fill.nvrtc_version(); assert v == '$(basename $(NVRTC_COMPAT))', v"
	touch $@

# CHUNKMETA_REQUIRE_SM90_COMPILE: a Triton that cannot compile for sm_90 here fails, not skips
test-triton-compat: $(COMPAT_STAMP)
	CHUNKMETA_REQUIRE_SM90_COMPILE=1 $(COMPAT_PY) -m pytest -p no:cacheprovider -o addopts="-ra" \
		tests/kernels/test_kernel_compiles.py

# Opt-in: the SGLang adapter against a real SGLang (CPU). Its own venv, .venv-sglang: SGLang's
# wheel without its dependencies (it pins another torch), then the pure-Python/CPU packages its
# backend modules import, every pip line pinned to torch==2.13.0 so nothing pulls another torch.
# Never torchvision: tests/integrations/sglang/sglang_cpu_stubs.py stands in for it. `rm -rf .venv-sglang` to rebuild.
.PHONY: test-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_DEPS := numpy orjson psutil pybase64 requests packaging pillow \
	starlette msgspec pydantic pyzmq tqdm IPython aiohttp dill einops gguf partial_json_parser uvicorn \
	fastapi triton transformers==5.19.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 \
	compressed-tensors==0.18.0 openai==2.8.0 pytest attrs
SGLANG_DEPS_STAMP := $(SGLANG_VENV)/.deps-$(call pins_hash,$(TORCH_PIN) $(SGLANG_VERSION) $(SGLANG_DEPS))
SGLANG_STAMP := $(SGLANG_VENV)/.chunkmeta-installed

$(SGLANG_DEPS_STAMP):
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN)
	rm -rf $(SGLANG_VENV)/wheels
	$(SGLANG_PY) -m pip download --quiet --no-deps -d $(SGLANG_VENV)/wheels sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) -m pip install --quiet --no-deps $(SGLANG_VENV)/wheels/sglang-*.whl
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN) $(SGLANG_DEPS)
	$(SGLANG_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(SGLANG_STAMP): $(SGLANG_DEPS_STAMP) pyproject.toml
	$(SGLANG_PY) -m pip install --quiet $(TORCH_PIN) -e .
	touch $@

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -p no:cacheprovider -o addopts="-ra" tests/integrations/sglang/test_sglang_real.py tests/integrations/sglang/test_sglang.py \
		tests/integrations/sglang/test_sglang_reference_real.py tests/integrations/sglang/test_sglang_mamba2_real.py

# Opt-in: the vLLM adapter against the real vLLM (CPU, VLLM_TARGET_DEVICE=cpu). Its own venv,
# .venv-vllm. Every install is --no-deps with torch==2.13.0 named explicitly: vLLM 0.33.0 pins
# torch==2.14.0 and CUDA wheels, which a resolving install would download (gigabytes). The vLLM
# wheel (336 MB) is downloaded once into VLLM_WHEEL_DIR. The suite's addopts name
# pytest-benchmark's flag, which this venv leaves out. `rm -rf .venv-vllm` to rebuild.
.PHONY: test-vllm
VLLM_VERSION ?= 0.33.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_WHEEL_DIR ?= $(VLLM_VENV)/wheels
VLLM_PIP := $(VLLM_PY) -m pip install --quiet --no-deps $(TORCH_PIN)
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

VLLM_DEPS_STAMP := $(VLLM_VENV)/.deps-$(call pins_hash,$(TORCH_PIN) $(VLLM_VERSION) $(VLLM_DEPS))
VLLM_STAMP := $(VLLM_VENV)/.chunkmeta-installed

$(VLLM_DEPS_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) $(VLLM_DEPS)
	ls $(VLLM_WHEEL_DIR)/vllm-$(VLLM_VERSION)-*.whl >/dev/null 2>&1 || \
		$(VLLM_PY) -m pip download --quiet --no-deps -d $(VLLM_WHEEL_DIR) vllm==$(VLLM_VERSION)
	$(VLLM_PIP) $(VLLM_WHEEL_DIR)/vllm-$(VLLM_VERSION)-*.whl
	$(VLLM_PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(VLLM_STAMP): $(VLLM_DEPS_STAMP) pyproject.toml
	$(VLLM_PIP) -e .
	touch $@

test-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -p no:cacheprovider -o addopts="-ra" \
		tests/integrations/vllm/test_vllm_real.py tests/integrations/vllm/test_vllm_reference_real.py \
		tests/integrations/vllm/test_vllm_tables_real.py tests/integrations/vllm/test_vllm_step_loop_smoke.py \
		tests/integrations/vllm/test_vllm_full_graph_real.py tests/integrations/vllm/test_vllm_full_graph_smoke.py \
		tests/integrations/vllm/test_vllm_mamba2_full_graph_real.py tests/integrations/vllm/test_vllm_mamba2_full_graph_smoke.py

# What a new user gets: a wheel built from this checkout, installed into a fresh venv (torch
# first, so that nothing pulls another), run from outside the checkout so that only the installed
# copy can be imported. Every tracked module and data file must be in it (a package missing from
# pyproject.toml's list, or package data not declared, fails here), and every module of
# chunkmeta.integrations must import without its engine.
WHEEL_TEST := $(or $(TMPDIR),/tmp)/chunkmeta-wheel-test
define WHEEL_CHECK
import importlib, pkgutil, sys
from pathlib import Path
import chunkmeta.integrations
from chunkmeta.replay import DEFAULT_TRACE
root = Path(chunkmeta.__file__).parent
assert root.is_relative_to(sys.prefix), f"chunkmeta imported from {root}, not from the wheel"
tracked = [p for p in Path(sys.argv[1]).read_text().split() if p.rsplit(".", 1)[-1] in ("py", "jsonl", "c", "cu", "h")]
installed = ["chunkmeta/" + p if p.startswith("integrations/") else p for p in tracked]
missing = [p for p in installed if not (root.parent / p).is_file()]
assert not missing, f"tracked but not in the wheel: {missing}"
modules = [m.name for m in pkgutil.walk_packages(chunkmeta.integrations.__path__, "chunkmeta.integrations.")]
for name in modules:
    importlib.import_module(name)
print(f"wheel: {len(installed)} tracked files installed; trace {DEFAULT_TRACE}; imported {', '.join(modules)}")
endef
export WHEEL_CHECK

test-wheel:
	rm -rf $(WHEEL_TEST)
	$(PYTHON) -m venv $(WHEEL_TEST)/venv
	$(WHEEL_TEST)/venv/bin/python -m pip install --quiet $(TORCH_PIN)
	rm -rf build  # setuptools reuses build/lib: files deleted from the tree would ship again
	$(WHEEL_TEST)/venv/bin/python -m pip wheel --quiet --no-deps . -w $(WHEEL_TEST)
	$(WHEEL_TEST)/venv/bin/python -m pip install --quiet $(TORCH_PIN) $(WHEEL_TEST)/chunkmeta-*.whl
	git ls-files chunkmeta integrations > $(WHEEL_TEST)/tracked.txt
	cd $(WHEEL_TEST) && venv/bin/python -c "$$WHEEL_CHECK" tracked.txt
	cd $(WHEEL_TEST) && venv/bin/python -m chunkmeta --no-fla --repeats 1
	rm -rf $(WHEEL_TEST)  # ~1 GB; left in place only when a step above failed, to look at

# Optional: clang-format the kernel sources with .clang-format. Releases break lines differently
# (14 indents the __launch_bounds__ kernel's signature): the config was tuned with
# `pip install clang-format==23.1.5`.
CLANG_FORMAT ?= clang-format
CSRC := $(wildcard chunkmeta/csrc/*.c chunkmeta/csrc/*.cu chunkmeta/csrc/*.h)
format-c:
	@command -v $(CLANG_FORMAT) >/dev/null || { echo "format-c: $(CLANG_FORMAT) not found (pip install clang-format==23.1.5)"; exit 1; }
	@test -n "$(CSRC)" || { echo "format-c: no sources in chunkmeta/csrc/"; exit 1; }
	$(CLANG_FORMAT) -i $(CSRC)

clean:
	rm -rf $(VENV) .venv-triton-* .pytest_cache .hypothesis .benchmarks .ruff_cache *.egg-info
