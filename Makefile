# The README's two commands. Both create .venv when missing and install the project into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MODEL  ?= checkpoints/v41-tiny
CHAT_MODEL ?= checkpoints/v41-tiny-chat
VL_MODEL ?= checkpoints/v41-tiny-vl
# pytest-xdist workers: 2 = the cores of the CI machines.
TEST_WORKERS ?= 2
# One OpenMP thread: the models here are small, and on a 2-core machine spinning OpenMP workers make a busy
# machine 10-20x slower (bench/README.md).
export OMP_NUM_THREADS ?= 1

.PHONY: run test test-slow lint clean fonts

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev]'
	touch $@ $(VENV)/.installed-run

# The main job: the bundled checkpoint continues a held-out prompt, then a second turn reuses its prefix; then the
# chat-tuned checkpoint answers a question and, given tools, calls one (tool_choice auto); then the tiny VLM reads
# the text of a held-out render back (example.txt holds what the image says).
run: $(VENV)/.installed-run
	$(BIN)/dsv41 generate --model $(MODEL) --prompt-file $(MODEL)/prompt.txt --max-tokens 64 \
		--follow-up "$$(cat $(MODEL)/follow_up.txt)"
	$(BIN)/dsv41 generate --model $(CHAT_MODEL) --chat --prompt-file $(CHAT_MODEL)/prompt.txt --max-tokens 128 \
		--tools $(CHAT_MODEL)/tools.json --follow-up "$$(cat $(CHAT_MODEL)/follow_up.txt)"
	@echo "$(VL_MODEL)/example.png says: $$(cat $(VL_MODEL)/example.txt)"
	$(BIN)/dsv41 generate --model $(VL_MODEL) --chat --image $(VL_MODEL)/example.png --prompt "Transcribe the text." \
		--max-tokens 24 --temperature 0

test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"

# The slow tests add the Ray executor's test and the NixlConnector's, so they install the ray and nixl extras (about
# 260 MB and 130 MB: not for `make test`).
$(VENV)/.installed-slow: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[dev,ray,nixl]'
	touch $@ $(VENV)/.installed-dev $(VENV)/.installed-run

# pytest exits 5 when no test carries the mark; that is not a failure.
test-slow: $(VENV)/.installed-slow
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m slow || [ $$? -eq 5 ]

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

# Debian's font packages whose faces the tiny VLM's training renders use (`dsv41 train-vlm`,
# deepseek_v41/train/vision_data.py: DejaVu, Liberation, FreeFont); without them it uses the faces that are installed,
# or Pillow's built-in font when none is.
FONT_PACKAGES := fonts-dejavu-core fonts-liberation fonts-freefont-ttf
fonts:
	@command -v apt-get >/dev/null || { echo "apt-get not found: install $(FONT_PACKAGES) or their equivalents"; exit 1; }
	apt-get install -y --no-install-recommends $(FONT_PACKAGES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
