//! corewire's native core.
//!
//! `core` holds all logic and uses no PyO3 types, so `cargo test --no-default-features`
//! runs without libpython. `py` (feature `python`) holds the thin binding types that the
//! extension module `corewire._native` exports.

pub mod core;

#[cfg(feature = "python")]
mod py;

#[cfg(feature = "python")]
#[pyo3::pymodule]
fn _native(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    py::register(m)
}
