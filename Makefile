# fedmeta — `make train`, `make test`. The first call builds .venv (scripts/install.sh).
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin

DATASET ?= rmnist
METHOD  ?= cafeme
SEED    ?= 0
# make download NAME=<data set> fetches one (fedmeta data download). Optional for train: PARTITION, VARIANT, ROUNDS, DEVICES, ACCELERATOR, STRATEGY, PRECISION, RESUME=1,
# VECTORIZE=1 (a round's clients as one vmapped computation), SEEDS="0 1 2" (stacked seeds in one process), and ARGS="key=value ..."
comma := ,
empty :=
space := $(empty) $(empty)
TRAIN_ARGS := dataset=$(DATASET) method=$(METHOD) $(if $(SEEDS),seeds=[$(subst $(space),$(comma),$(strip $(SEEDS)))],seed=$(SEED)) \
	$(if $(VECTORIZE),federation.vectorize=true) \
	$(if $(PARTITION),partition=$(PARTITION)) $(if $(VARIANT),variant=$(VARIANT)) \
	$(if $(ROUNDS),federation.rounds=$(ROUNDS)) $(if $(DEVICES),fabric.devices=$(DEVICES)) \
	$(if $(ACCELERATOR),fabric.accelerator=$(ACCELERATOR)) $(if $(STRATEGY),fabric.strategy=$(STRATEGY)) \
	$(if $(PRECISION),fabric.precision=$(PRECISION)) $(if $(RESUME),output.resume=true) $(ARGS)

.PHONY: install train test test-all lint config describe download table figures bench tensorboard clean-env \
	gpu-kit gpu-rehearse

install: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/install.sh
	touch $@

train: install  # the run stopped on purpose (SIGTERM, its deadline), checkpointed (exit 75), is not make's error
	$(BIN)/fedmeta train $(TRAIN_ARGS) || { status=$$?; [ $$status -eq 75 ] || exit $$status; }

config: install
	$(BIN)/fedmeta train --print-config $(TRAIN_ARGS)

describe: install
	$(BIN)/fedmeta data describe $(DATASET) $(PARTITION) $(ARGS)

# make table [PRESET=quick|paper] [DATASETS="rmnist cifar10-shards"] [METHODS="cafeme fedavg_ft"] [SEEDS="0 1 2"] [PARALLEL=2]
#            [VECTORIZE=1: vmapped clients, and each method's seeds stacked in one process]
PRESET   ?= quick
PARALLEL ?= $(if $(shell command -v nvidia-smi),,2)# on a GPU machine fedmeta runs every process at once, sharing the card
GRID_ARGS := --preset $(PRESET) $(if $(PARALLEL),--parallel $(PARALLEL)) $(if $(DATASETS),--datasets $(DATASETS)) \
	$(if $(METHODS),--methods $(METHODS)) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(VECTORIZE),federation.vectorize=true)

table: install
	$(BIN)/fedmeta table $(GRID_ARGS) $(ARGS)

# make bench [DATASETS="rmnist cifar10"] [METHODS="cafeme fedavg"] [PROFILE=1] [COUNT=1: kernels, bytes → results/census.json] [PROJECT=paper] [ARGS="fabric.accelerator=cuda"] → results/bench.json
bench: install
	$(BIN)/fedmeta bench $(if $(DATASETS),--datasets $(DATASETS)) $(if $(METHODS),--methods $(METHODS)) $(if $(PROFILE),--profile) $(if $(COUNT),--count) \
	$(if $(PROJECT),--project $(PROJECT)) $(ARGS)

figures: install
	$(BIN)/fedmeta figures $(GRID_ARGS) $(if $(RUN),--run) $(ARGS)

# make tensorboard [RUNS=runs]: every run's metrics and personalization curves, offline (http://localhost:6006)
RUNS ?= runs
tensorboard: install
	$(BIN)/tensorboard --logdir $(RUNS)

download: install
	$(BIN)/fedmeta data download $(NAME) $(ARGS)

# One worker process per core, one torch thread each (tests/conftest.py); a test file's tests share
# a worker, so its module fixtures are built once; the files go out in conftest's order.
# TEST_WORKERS=0 runs them all in this process.
TEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install      # the quick tier
	$(PYTEST) -m "not slow"

test-all: install  # everything, as CI runs it
	$(PYTEST)

lint: install      # formatting, lint rules and the import layers (pyproject.toml), as CI checks them
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# make gpu-kit [SETTINGS="rmnist-shards cifar10-shards"]: .gpu/, what a GPU lease carries beside the tree (the wheels
# the card's image lacks, the settings' data files); refused if it would not fit a lease's 64 MiB
SETTINGS ?= rmnist-shards
gpu-kit: install
	$(BIN)/python scripts/gpu_kit.py $(SETTINGS)

# make gpu-rehearse [JOB=stand-in]: a lease simulated on this CPU: jobs killed, collected out of order, resumed (.cache/rehearse/rehearsal.log)
gpu-rehearse:
	$(if $(JOB),JOB=$(JOB)) bash scripts/gpu_rehearse.sh

clean-env:
	rm -rf $(VENV)
