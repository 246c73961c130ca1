//! torch, imported on the first tensor (torch is optional for corewire).

use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};

/// Torch dtypes that numpy has too (wire name, numpy dtype string): tensors of these are
/// made as `torch.from_numpy` of a numpy view, one C-level array and one call, instead of
/// `torch.frombuffer` and a `view`.
const NUMPY_TWINS: [(&str, &str); 11] = [
    ("float32", "<f4"),
    ("float64", "<f8"),
    ("float16", "<f2"),
    ("int64", "<i8"),
    ("int32", "<i4"),
    ("int16", "<i2"),
    ("int8", "|i1"),
    ("uint8", "|u1"),
    ("bool", "|b1"),
    ("complex64", "<c8"),
    ("complex128", "<c16"),
];

/// The torch functions the decoder calls.
pub struct TorchApi {
    pub frombuffer: Py<PyAny>,
    pub from_numpy: Py<PyAny>,
    pub empty: Py<PyAny>,
    /// The numpy dtype object of each of [`NUMPY_TWINS`], in that order.
    numpy_twins: Vec<Py<PyAny>>,
    module: Py<PyAny>,
    dtype_type: Py<PyAny>,
    warnings: Py<PyAny>,
    /// A `warnings.filters` entry ignoring exactly torch's read-only buffer warning.
    quiet_entry: Py<PyAny>,
    filters_mutated: Option<Py<PyAny>>,
}

static TORCH: PyOnceLock<TorchApi> = PyOnceLock::new();

/// torch's functions (imports torch on first use; fails if torch is not installed).
pub fn api(py: Python<'_>) -> PyResult<&'static TorchApi> {
    TORCH.get_or_try_init(py, || load(py))
}

fn load(py: Python<'_>) -> PyResult<TorchApi> {
    let torch = py.import("torch")?;
    let warnings = py.import("warnings")?;
    let pattern = py
        .import("re")?
        .call_method1("compile", ("The given buffer is not writable",))?;
    let user_warning = py.get_type::<pyo3::exceptions::PyUserWarning>();
    let quiet_entry = PyTuple::new(
        py,
        [
            "ignore".into_pyobject(py)?.into_any(),
            pattern,
            user_warning.into_any(),
            py.None().into_bound(py),
            0i32.into_pyobject(py)?.into_any(),
        ],
    )?;
    let np_dtype = py.import("numpy")?.getattr("dtype")?;
    let numpy_twins = NUMPY_TWINS
        .iter()
        .map(|(_, np)| np_dtype.call1((*np,)).map(Bound::unbind))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(TorchApi {
        frombuffer: torch.getattr("frombuffer")?.unbind(),
        from_numpy: torch.getattr("from_numpy")?.unbind(),
        numpy_twins,
        empty: torch.getattr("empty")?.unbind(),
        dtype_type: torch.getattr("dtype")?.unbind(),
        filters_mutated: warnings.getattr("_filters_mutated").ok().map(Bound::unbind),
        warnings: warnings.into_any().unbind(),
        quiet_entry: quiet_entry.into_any().unbind(),
        module: torch.into_any().unbind(),
    })
}

/// The torch dtype named `s` (`"bfloat16"`) and its itemsize; `None` if torch has no
/// such dtype.
pub fn dtype<'py>(py: Python<'py>, s: &str) -> PyResult<Option<(Bound<'py, PyAny>, usize)>> {
    let api = api(py)?;
    let candidate = match api.module.bind(py).getattr(s) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyMemoryError>(py) => return Err(e),
        Err(_) => return Ok(None),
    };
    if !candidate.is_instance(api.dtype_type.bind(py))? {
        return Ok(None);
    }
    let itemsize: usize = candidate.getattr("itemsize")?.extract()?;
    Ok(Some((candidate, itemsize)))
}

impl TorchApi {
    /// The numpy dtype with the same layout as torch dtype `name`, if numpy has one.
    #[inline]
    pub fn numpy_twin<'py>(&self, py: Python<'py>, name: &str) -> Option<&Bound<'py, PyAny>> {
        NUMPY_TWINS
            .iter()
            .position(|(t, _)| *t == name)
            .map(|i| self.numpy_twins[i].bind(py))
    }

    /// Runs `f` with torch's "buffer is not writable" warning ignored, and nothing else.
    ///
    /// The filter goes in front of `warnings.filters` and comes out right after; no
    /// Python code runs in between other than `f` (torch's C++), so no other thread can
    /// see it.
    pub fn without_readonly_warning<'py, T>(
        &self,
        py: Python<'py>,
        f: impl FnOnce() -> PyResult<T>,
    ) -> PyResult<T> {
        let filters = self.warnings.bind(py).getattr("filters")?;
        let Ok(filters) = filters.cast_into::<PyList>() else {
            return f();
        };
        let entry = self.quiet_entry.bind(py);
        filters.insert(0, entry)?;
        self.mutated(py);
        let result = f();
        let position = filters.iter().position(|item| item.is(entry));
        if let Some(i) = position {
            filters.del_item(i)?;
        }
        self.mutated(py);
        result
    }

    fn mutated(&self, py: Python<'_>) {
        if let Some(f) = &self.filters_mutated {
            // Invalidates the warning registries' caches; failing to is harmless.
            let _ = f.bind(py).call0();
        }
    }
}
