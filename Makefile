# hana-storage-formula: `make demo` runs the lab, `make test` runs every tier.
VENV   := .venv/bin
PYTEST := $(VENV)/pytest -p no:cacheprovider

.PHONY: deps demo test test-unit test-integration test-vm bench lint clean

deps:
	@tools/install-deps.sh

demo: deps
	$(VENV)/python lab/demo.py

test: deps lint
	$(PYTEST) tests/unit -q
	$(PYTEST) tests/integration -q
	$(PYTEST) tests/vm -q --durations=15

test-unit: deps
	$(PYTEST) tests/unit -q

test-integration: deps
	$(PYTEST) tests/integration -q

test-vm: deps
	$(PYTEST) tests/vm -q --durations=15

# benchmarks (about 40 min under emulation): table printed, kept in build/bench/results.{json,md}
bench: deps
	$(PYTEST) bench -q

lint: deps
	$(VENV)/ruff check -q .
	$(VENV)/ruff format -q --check .
	$(VENV)/salt-lint salt/hana/storage/*.sls salt/hana/storage/*/*.sls

clean:
	rm -rf build .pytest_cache .ruff_cache .hypothesis
