//! `SendTracker`: the binding of [`crate::core::tracker::Tracker`] for zero-copy sends.

use pyo3::intern;
use pyo3::prelude::*;

use crate::core::tracker::Tracker;

/// Keeps the objects behind zero-copy frames alive until ZeroMQ has sent them.
///
/// Each entry pairs a ``zmq.MessageTracker`` with the objects (tensors, arrays) whose
/// memory the frames point into. Entries are released oldest first once their tracker is
/// ``done``; reaping stops at the first send still in flight, so it costs one check in
/// the common case.
#[pyclass(module = "corewire._native", name = "SendTracker")]
pub struct SendTracker {
    inner: Tracker<(Py<PyAny>, Py<PyAny>)>,
}

fn is_done(py: Python<'_>, tracker: &Py<PyAny>) -> PyResult<bool> {
    tracker.bind(py).getattr(intern!(py, "done"))?.is_truthy()
}

#[pymethods]
impl SendTracker {
    /// An empty tracker.
    #[new]
    fn new() -> Self {
        Self {
            inner: Tracker::new(),
        }
    }

    /// Keeps ``objects`` alive until ``tracker.done``; first releases finished sends.
    ///
    /// A tracker that is already done is not stored at all.
    fn track(slf: &Bound<'_, Self>, tracker: Py<PyAny>, objects: Py<PyAny>) -> PyResult<()> {
        let py = slf.py();
        Self::reap(slf)?;
        if !is_done(py, &tracker)? {
            slf.borrow_mut().inner.push((tracker, objects));
        }
        Ok(())
    }

    /// Releases the oldest sends that ZeroMQ has finished; returns how many.
    fn reap(slf: &Bound<'_, Self>) -> PyResult<usize> {
        let py = slf.py();
        let mut released = 0;
        loop {
            // `done` is Python code that may switch threads: hold no borrow while it runs,
            // then pop only if the entry checked is still the oldest.
            let Some(oldest) = slf.borrow().inner.oldest().map(|e| e.0.clone_ref(py)) else {
                break;
            };
            if !is_done(py, &oldest)? {
                break;
            }
            let entry = slf.borrow_mut().inner.pop_oldest_if(|e| e.0.is(&oldest));
            // Dropped here, after the borrow: releasing a tensor may run Python code.
            released += usize::from(entry.is_some());
        }
        Ok(released)
    }

    /// Forgets every entry (the sockets are closed; nothing is in flight any more).
    fn clear(slf: &Bound<'_, Self>) -> usize {
        let entries = slf.borrow_mut().inner.clear();
        entries.len()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("SendTracker(pending={})", self.inner.len())
    }
}
