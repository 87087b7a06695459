# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the suite, both lanes).
# The first interpreter of that version that actually runs (a pyenv shim for an inactive version does not).
find_py = $(shell for p in python$(1) $(HOME)/.pyenv/versions/$(1).*/bin/python$(1); do \
            $$p -c 'import sys; assert sys.version_info[:2] == ($(subst .,$(comma),$(1)))' 2>/dev/null \
            && { command -v $$p; break; }; done)
comma := ,
PY312 ?= $(call find_py,3.12)
PY311 ?= $(call find_py,3.11)
VENV := .venv
OLD := .venv-oldest

.PHONY: demo test test-newest test-oldest clean

# uv (pinned, pip-installed into each environment) installs the pinned requirements: the newest lane's CUDA build
# of torch took pip 104 s to download and unpack; uv builds both environments in 44 s, bytecode compiled. A wheel
# folder pip is told of (PIP_FIND_LINKS, as on machines that keep the CPU build of torch for Python 3.11) is handed
# to uv too, so both resolve the same files. --compile-bytecode: pip writes the .pyc files at install, uv only when
# asked; without them every process (each rank of each test) compiles torch and Megatron from source where
# PYTHONDONTWRITEBYTECODE is set (the suite ran 1206 s instead of about 800).
UV := uv==0.13.9
FIND_LINKS = $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

# $(call venv,folder,python,version word,requirements file): one environment, made the same way for both lanes
define venv
	@test -n "$(2)" || { echo "Python $(3) not found: install it or pass PY$(subst .,,$(3))=/path/to/python$(3)" >&2; exit 1; }
	$(2) -m venv $(1)
	$(1)/bin/pip install -q $(UV)
	$(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python $(FIND_LINKS) -r $(4)
	$(1)/bin/uv pip install -q --python $(1)/bin/python --no-deps -e .
	touch $(1)/.ok
endef

$(VENV)/.ok: requirements/newest.txt
	$(call venv,$(VENV),$(PY312),3.12,requirements/newest.txt)

$(OLD)/.ok: requirements/oldest.txt
	$(call venv,$(OLD),$(PY311),3.11,requirements/oldest.txt)

demo: $(VENV)/.ok
	$(VENV)/bin/python examples/pretrain_tiny_gpt.py

# The two environments build side by side (mostly download and unpack); then the lanes run one after the other
# (run side by side, even with the oldest at nice 19, the newest lane took 1191 s instead of 790 s).
test:
	$(MAKE) -j2 $(VENV)/.ok $(OLD)/.ok
	$(MAKE) --no-print-directory test-newest
	$(MAKE) --no-print-directory test-oldest

test-newest: $(VENV)/.ok
	$(VENV)/bin/python -m pytest -q --durations=30

# The oldest lane checks the Megatron-facing code against megatron-core 0.16.1: tests/megatron, and the one pure
# file that imports megatron-core (the lane's pinned imports; tests/pure/test_environment.py checks no other pure
# file does). The operators, schedules, planner and benchmarks do not depend on the Megatron version and run
# once, in the newest lane.
OLDEST_TESTS := tests/megatron tests/pure/test_environment.py
test-oldest: $(OLD)/.ok
	$(OLD)/bin/python -m pytest -q --durations=15 -m "not newest_only" $(OLDEST_TESTS)

clean:
	rm -rf $(VENV) $(OLD)
