# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the suite, both lanes).
PY312 ?= $(shell command -v python3.12 || echo $(HOME)/.pyenv/versions/3.12.1/bin/python)
PY311 ?= $(shell command -v python3.11 || echo $(HOME)/.pyenv/versions/3.11.7/bin/python)
VENV := .venv
OLD := .venv-oldest

.PHONY: demo test test-newest test-oldest clean

$(VENV)/.ok: requirements/newest.txt
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements/newest.txt
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

$(OLD)/.ok: requirements/oldest.txt
	$(PY311) -m venv $(OLD)
	$(OLD)/bin/pip install -q -r requirements/oldest.txt
	$(OLD)/bin/pip install -q --no-deps -e .
	touch $@

demo: $(VENV)/.ok
	$(VENV)/bin/python examples/train_tiny_gpt.py

test: test-newest test-oldest

test-newest: $(VENV)/.ok
	$(VENV)/bin/python -m pytest -q

test-oldest: $(OLD)/.ok
	$(OLD)/bin/python -m pytest -q -m "not newest_only"

clean:
	rm -rf $(VENV) $(OLD)
