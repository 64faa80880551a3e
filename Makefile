# hana-storage-formula: `make demo` runs the lab, `make test` runs every tier on every Salt line.
LINES  := $(shell awk '!/^\#/ && NF {print $$1}' requirements/salt.in)
OLDEST := $(firstword $(LINES))
NEWEST := $(lastword $(LINES))
# the newest line's venv is .venv (lint, lab, VM tier); the others are .venv-<line>
venv    = $(if $(filter $(1),$(NEWEST)),.venv,.venv-$(1))
PYTEST := -m pytest -p no:cacheprovider

.PHONY: deps demo test test-all test-unit test-integration test-vm bench lint clean

deps:
	@tools/install-deps.sh

# make demo KEY=tang: every volume bound to a real tangd on the host's loopback instead
demo: deps
	.venv/bin/python lab/demo.py $(if $(KEY),--key $(KEY))

# Lint first (a fast failure); then the unit and integration tiers run beside the VM tier, the
# critical path: their daemons mostly wait, while each emulated guest keeps about one core busy.
# The VM tier's summary (which module failed, and why) is printed again last.
test: deps lint
	@mkdir -p build/test-logs; rm -f build/test-logs/vm-summary.txt; \
	( $(MAKE) --no-print-directory test-unit && \
	  $(MAKE) --no-print-directory test-integration; echo $$? >build/test-logs/beside.rc ) \
	  >build/test-logs/beside.log 2>&1 & \
	echo "== unit and integration tiers beside the VM tier (log: build/test-logs/beside.log)"; \
	$(MAKE) --no-print-directory test-vm; vm=$$?; \
	echo "== waiting for the unit and integration tiers"; wait; cat build/test-logs/beside.log; \
	echo "== the VM tier, again"; cat build/test-logs/vm-summary.txt 2>/dev/null; \
	[ $$vm = 0 ] && [ "$$(cat build/test-logs/beside.rc)" = 0 ]

# make test and what it leaves out (the VM scenarios marked long, the integration tier on 3007:
# docs/DEVELOPING.md says which and why): for a release and for a change to what they cover
test-all:
	@$(MAKE) --no-print-directory test VM_MARKS= INTEGRATION_LINES="$(LINES)"

# unit and integration on every supported Salt line, each in its own venv (requirements/salt.in)
UNIT_LINES ?= $(LINES)
test-unit: deps
	@set -e; for line in $(UNIT_LINES); do \
	  echo "== unit tier, Salt $$line"; \
	  v=.venv-$$line; [ $$line = $(NEWEST) ] && v=.venv; $$v/bin/python $(PYTEST) tests/unit -q; \
	done

# the lines side by side (their daemons mostly wait): each logs to build/test-logs/, printed after.
# make test runs the oldest and the newest line (3007's loaders are in the unit tier), test-all all
INTEGRATION_LINES ?= $(OLDEST) $(NEWEST)
test-integration: deps
	@mkdir -p build/test-logs; pids=""; for line in $(INTEGRATION_LINES); do \
	  v=.venv-$$line; [ $$line = $(NEWEST) ] && v=.venv; \
	  ( $$v/bin/python $(PYTEST) tests/integration -q >build/test-logs/integration-$$line.log 2>&1; \
	    echo $$? >build/test-logs/integration-$$line.rc ) & pids="$$pids $$!"; \
	done; echo "== integration tier, Salt $(INTEGRATION_LINES) side by side (logs: build/test-logs/)"; wait $$pids; \
	rc=0; for line in $(INTEGRATION_LINES); do \
	  echo "== integration tier, Salt $$line"; tail -n 15 build/test-logs/integration-$$line.log; \
	  [ "$$(cat build/test-logs/integration-$$line.rc)" = 0 ] || rc=1; \
	done; exit $$rc

# the real kernel on the newest line, its events module (a real minion daemon and its beacon in
# the guest, two hot masters and their Redis store on the host) on EVENTS_LINES, by default the
# oldest line only (the integration tier runs the real beacon in a real minion daemon on every
# line; make test-vm EVENTS_LINES="3006 3008" for more), and the day-two states' encryption in
# place on OLDEST_MODULES' line, the oldest (SUSE Manager's 3006): each module once, on one line.
# Modules run in VM_LANES lanes side by side, one lab VM per lane (tools/vm-lanes): each
# emulated guest keeps about one core busy.
# VM_MARKS: the pytest marker expression the VM modules run with (make test-all: every scenario)
VM_MARKS ?= not long
EVENTS_LINES ?= $(OLDEST)
VM_LANES ?= $(shell n=$$(nproc); [ $$n -ge 2 ] && echo 2 || echo 1)
OLDEST_MODULES ?= tests/vm/test_in_place.py
VM_MODULES ?= $(filter-out tests/vm/test_events.py $(OLDEST_MODULES),$(wildcard tests/vm/test_*.py))
test-vm: deps
	@echo "== VM tier: Salt $(NEWEST), the events module on $(EVENTS_LINES), $(OLDEST_MODULES) on $(OLDEST), $(VM_LANES) lanes, $(if $(VM_MARKS),the tests of '$(VM_MARKS)',every test)"
	@tools/vm-lanes --lanes $(VM_LANES) --marks "$(VM_MARKS)" $(foreach m,$(VM_MODULES),$(NEWEST):$(m)) \
	  $(foreach m,$(OLDEST_MODULES),$(OLDEST):$(m)) \
	  $(foreach l,$(EVENTS_LINES),$(l):tests/vm/test_events.py)

# benchmarks (at most 44 min under emulation): table printed, kept in build/bench/results.{json,md}
bench: deps
	.venv/bin/python $(PYTEST) bench -q

# no QEMU, no kernel: only the newest line's venv; the tools' scripts have no .py for ruff to find
TOOLS := tools/import-graph tools/lock-requirements tools/vm-lanes
lint:
	@tools/install-deps.sh --lint
	.venv/bin/ruff check -q . $(TOOLS)
	.venv/bin/ruff format -q --check . $(TOOLS)
	.venv/bin/vermin -q --no-tips --violations --target=3.10- --eval-annotations _modules _states _beacons _runners _engines _utils
	.venv/bin/salt-lint salt/hana/storage/*.sls  # reactor/*.sls is #!py: ruff
	.venv/bin/python tools/import-graph --check  # layers without cycles: loader modules -> hana_storage_core

clean:
	rm -rf build .pytest_cache .ruff_cache .hypothesis
