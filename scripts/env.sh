# Sourced by scripts/test and scripts/demo: creates (once) and activates the project's
# virtual environment, outside the checkout so that CI and later runs reuse the large
# torch install. Override the location with COREWIRE_VENV.
COREWIRE_VENV="${COREWIRE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/corewire/ci-venv}"
if [ ! -x "$COREWIRE_VENV/bin/python" ]; then
    echo "== creating virtual environment $COREWIRE_VENV"
    python3 -m venv "$COREWIRE_VENV"
    "$COREWIRE_VENV/bin/python" -m pip install -q --upgrade pip
fi
export VIRTUAL_ENV="$COREWIRE_VENV"
export PATH="$COREWIRE_VENV/bin:$PATH"
# maturin is needed before the project itself can be built.
python -m pip install -q "maturin>=1.5,<2"

# vLLM's front-end needs a platform on a machine without a GPU: this test/serve-only plugin
# names vLLM's CPU platform. Installed here, never a dependency of corewire itself.
install_cpu_platform() {
    python -m pip install -q "$(dirname "${BASH_SOURCE[0]}")/../tools/vllm-cpu-platform"
}
