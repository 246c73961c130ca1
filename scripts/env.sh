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
# maturin is needed before the project itself can be built; zig, from the package index,
# links the manylinux2014 wheel against glibc 2.17 (`maturin build --zig`), pinned to the
# release that scripts/test was checked with.
python -m pip install -q "maturin>=1.9,<2" "ziglang==0.17.1"

# vLLM's front-end needs a platform on a machine without a GPU: this test/serve-only plugin
# names vLLM's CPU platform. Installed here, never a dependency of corewire itself.
install_cpu_platform() {
    python -m pip install -q "$(dirname "${BASH_SOURCE[0]}")/../tools/vllm-cpu-platform"
}

# vLLM 0.33.0 cannot share an environment with 0.25.1: the tests against it run in a second
# cached venv beside the first (override with COREWIRE_VENV_0_33). Created and filled once
# (vLLM 0.33.0 with its torch: about 5 minutes and 9 GB on a first run), reused after.
COREWIRE_VENV_0_33="${COREWIRE_VENV_0_33:-${XDG_CACHE_HOME:-$HOME/.cache}/corewire/vllm-0.33.0-venv}"
ensure_vllm_0_33_venv() {
    local py="$COREWIRE_VENV_0_33/bin/python"
    if [ ! -x "$py" ]; then
        echo "== creating virtual environment $COREWIRE_VENV_0_33"
        python3 -m venv "$COREWIRE_VENV_0_33"
        "$py" -m pip install -q --upgrade pip
    fi
    "$py" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"' 2>/dev/null \
        || "$py" -m pip install -q "vllm==0.33.0"
    "$py" -m pip install -q "$(dirname "${BASH_SOURCE[0]}")/../tools/vllm-cpu-platform"
}
