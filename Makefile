# Every target creates or refreshes .venv itself (pinned by requirements/constraints.txt).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@echo "installing dpsweep and its pinned dependencies into $(VENV) (a few minutes the first time; log: $(VENV)/install.log)"
	$(BIN)/pip install -q -c requirements/constraints.txt -e '.[dev]' > $(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	$(BIN)/python -c "import torch, torchvision, ray, mlflow, opacus, dp_accounting, scipy, pydantic" 
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dpsweep run sweeps/quickstart.yaml

# two pytest-xdist workers, a test file each at a time (module fixtures such as a test's own Ray stay in
# one worker); PYTEST_WORKERS=0 runs the suite in one process
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

bench: $(STAMP)
	$(BIN)/python benchmarks/pixeldp_mnist.py

clean:
	rm -rf $(VENV) build *.egg-info
