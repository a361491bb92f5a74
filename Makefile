# The two README commands are `make run` and `make test`; each installs what it needs first.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: run test lint images compose-lab bench bench-quick bench-pageload bench-tunnel-cpu soak

run:
	@ci/install.sh
	$(VENV)/bin/egresswall run --policy policy/default.yaml --listen 127.0.0.1:3128

# The images are built first: tests/test_containment_compose.py runs the compose topology from their root
# filesystems (README, "Deployment proven").
test:
	@ci/install.sh --all --images
	@if [ "$$(id -u)" -eq 0 ]; then ci/images.sh; \
	 else echo "make test: not root, so no images are built (the lab tests, which need root, skip)"; fi
	$(PY) -m ruff check policy proxy browser squid-compat ci tests
	$(PY) -m pytest tests

# The proxy, browser and netlock images from compose/Dockerfile.* (buildah, on a Debian base made with
# mmdebstrap), their root filesystems exported to build/images/ (ci/images.sh; IMAGES_ARGS e.g. "--only proxy").
images:
	@ci/install.sh --images
	ci/images.sh $(IMAGES_ARGS)

# The compose topology in the containment lab, by hand, with its negative twin (make test runs it too).
compose-lab: images
	ci/compose-lab --negative

lint:
	$(PY) -m ruff check policy proxy browser squid-compat ci tests

bench:
	@ci/install.sh --bench
	$(PY) tests/benchmarks/bench_proxy.py $(BENCH_ARGS)

bench-quick:
	@ci/install.sh --bench
	$(PY) tests/benchmarks/bench_proxy.py --quick

# Chromium from egresswall's launcher loads a 60-subresource HTTPS page from 12 names, direct, via squid and
# via egresswall (README, speed section). BENCH_ARGS e.g. "--rounds 5".
bench-pageload:
	@ci/install.sh --bench --browser
	$(PY) tests/benchmarks/bench_pageload.py $(BENCH_ARGS)

# CPU per TLS tunnel set-up from /proc: squid, egresswall's front with no checks (floor_relay.py) and
# egresswall, then the gate's steps one by one (README, speed section). BENCH_ARGS e.g. "--tunnels 500".
bench-tunnel-cpu:
	@ci/install.sh --bench
	$(PY) tests/benchmarks/bench_tunnel_cpu.py $(BENCH_ARGS)

# The full hardening load: 1,000 clients for a minute, then kill -9 mid-load; prints its figures
# (the test run has a 200-client, 10-second version). SOAK_ARGS e.g. "--clients 500 --seconds 30".
soak:
	@ci/install.sh
	$(PY) tests/benchmarks/soak.py $(SOAK_ARGS)
