//! `CallRegistry`: the binding of [`crate::core::registry::Registry`] holding futures.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyType};

use crate::core::registry::Registry;

/// `corewire.errors.EngineDeadError`, looked up once.
static ENGINE_DEAD_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

#[cold]
#[inline(never)]
fn engine_dead_error(py: Python<'_>) -> PyErr {
    match ENGINE_DEAD_ERROR.import(py, "corewire.errors", "EngineDeadError") {
        Ok(cls) => PyErr::from_type(cls.clone(), "Engine core died; no new call can be made."),
        Err(err) => err,
    }
}

/// Maps the call id of each utility call in flight to the future its caller awaits.
///
/// Ids are unsigned 64-bit integers from a random start (ids above 2**63 are normal).
/// A reply whose id is unknown (cancelled caller, stray or duplicate reply) gets
/// ``None`` from :meth:`pop` and changes nothing. The registry never touches the futures:
/// the Python side creates them and sets their results.
#[pyclass(module = "corewire._native", name = "CallRegistry")]
pub struct CallRegistry {
    inner: Registry<Py<PyAny>>,
}

#[pymethods]
impl CallRegistry {
    /// An empty registry; ``start`` fixes the first id (default: random).
    #[new]
    #[pyo3(signature = (start=None))]
    fn new(start: Option<u64>) -> Self {
        let inner = match start {
            Some(start) => Registry::starting_at(start),
            None => Registry::new(),
        };
        Self { inner }
    }

    /// Stores ``future`` under a fresh call id and returns the id.
    ///
    /// Raises ``EngineDeadError`` once :meth:`drain` has closed the registry.
    fn register(&mut self, py: Python<'_>, future: Py<PyAny>) -> PyResult<u64> {
        self.inner
            .register(future)
            .map_err(|_| engine_dead_error(py))
    }

    /// Removes and returns the future of ``call_id``; ``None`` when it is not pending.
    ///
    /// Any object is accepted: an id that is not an unsigned 64-bit integer (``-1``
    /// notifications, garbage from a peer) simply is not pending.
    fn pop(&mut self, call_id: &Bound<'_, PyAny>) -> Option<Py<PyAny>> {
        let id = call_id.extract::<u64>().ok()?;
        self.inner.pop(id)
    }

    /// Forgets ``call_id`` (its caller gave up); returns whether it was pending.
    fn discard(slf: &Bound<'_, Self>, call_id: &Bound<'_, PyAny>) -> bool {
        let Ok(id) = call_id.extract::<u64>() else {
            return false;
        };
        // Release the borrow before the future is dropped: its finaliser may run Python
        // code that uses this registry again.
        let removed = slf.borrow_mut().inner.pop(id);
        removed.is_some()
    }

    /// Removes and returns every pending future (to fail them when the engine dies).
    ///
    /// With ``close=True`` later :meth:`register` calls raise ``EngineDeadError``.
    #[pyo3(signature = (*, close=false))]
    fn drain<'py>(slf: &Bound<'py, Self>, close: bool) -> PyResult<Bound<'py, PyList>> {
        let futures = slf.borrow_mut().inner.drain(close);
        PyList::new(slf.py(), futures)
    }

    /// Whether :meth:`drain` closed the registry.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    fn __contains__(&self, call_id: &Bound<'_, PyAny>) -> bool {
        call_id
            .extract::<u64>()
            .is_ok_and(|id| self.inner.contains(id))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "CallRegistry(pending={}, closed={})",
            self.inner.len(),
            if self.inner.is_closed() {
                "True"
            } else {
                "False"
            }
        )
    }
}
