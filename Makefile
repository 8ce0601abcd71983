# `make demo` and `make test` work on a fresh machine: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO := .demo-model

.PHONY: install demo serve test protos clean

$(BIN)/tandem: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned: anything that depends on an unpinned torch would pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Build the native expert kernel now (cached), not at the first request; failure is not fatal.
	$(BIN)/python -m tandem.experts.build
	touch $@

install: $(BIN)/tandem

$(DEMO)/config.json: | $(BIN)/tandem
	$(BIN)/tandem make-demo-model $(DEMO) --arch mixtral

demo: $(DEMO)/config.json
	$(BIN)/tandem generate --model $(DEMO) --prompt "The expert said" --max-tokens 24 --json

serve: $(DEMO)/config.json
	$(BIN)/tandem serve --model $(DEMO) --listen 127.0.0.1:50051 --metrics-port 9400

test: $(BIN)/tandem
	$(BIN)/python -m pytest -q

protos: $(BIN)/tandem
	$(BIN)/python -m tandem.rpc.codegen

clean:
	rm -rf $(VENV) $(DEMO)
