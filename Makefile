# agentrl: `make demo` and `make test` do all set-up on a fresh machine (see README).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentrl-installed
# the agent frameworks (OpenAI Agents SDK, LangGraph) in their own venv: they need openai>=3, SGLang pins 2.8.0
AGENTS_VENV ?= .venv-agents
PYTEST_ARGS ?=

.PHONY: install system test test-fast demo demo-smoke bench lint clean-venv

install: system $(STAMP)

# Debian packages by profile (scripts/install_system.sh): `make test` needs the Docker ones and Redis 7, the rest
# only bubblewrap and the sandbox's python3; $AGENTRL_SYSTEM (demo|docker|test|none) overrides the choice.
SYSTEM_PROFILE = demo
test: SYSTEM_PROFILE = test
system:
	@bash scripts/install_system.sh $(or $(AGENTRL_SYSTEM),$(SYSTEM_PROFILE))

$(STAMP): pyproject.toml requirements/sglang-cpu.txt scripts/install_venv.sh
	bash scripts/install_venv.sh $(VENV)
	@touch $(STAMP)

test: install
	@if [ "$${AGENTRL_SKIP_DOCKER:-0}" = 1 ]; then echo "agentrl: AGENTRL_SKIP_DOCKER=1: Docker tests will skip"; \
	  else bash scripts/ensure_docker.sh; fi
	bash scripts/install_agents_venv.sh $(AGENTS_VENV)
	AGENTRL_AGENTS_VENV=$(AGENTS_VENV) $(VENV)/bin/pytest $(PYTEST_ARGS)

test-fast: install
	$(VENV)/bin/pytest -m "not slow and not sglang" $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/agentrl demo

demo-smoke: install
	$(VENV)/bin/agentrl demo --smoke

bench: install
	@for b in benchmarks/[!_]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: install
	$(VENV)/bin/ruff check agentrl tests benchmarks
	$(VENV)/bin/mypy agentrl

clean-venv:
	rm -rf $(VENV) $(AGENTS_VENV)
