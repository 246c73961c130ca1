//! `corewire._native.Router`: the data-parallel routing decision (see `core::router`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::core::router::{Router as CoreRouter, RouterError};

fn to_py_err(err: RouterError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// Chooses the engine for each request of a data-parallel front-end.
///
/// Load per engine is `max(waiting + running + clients * sent_since_update,
/// clients * in_flight)`: the coordinator's last counts plus what this client sent since,
/// floored by this client's requests in flight, this client's counts scaled by the
/// number of front-ends routing over the same engines (`client_count`, vLLM's API
/// servers). The least loaded engine wins; ties go to fewer waiting requests, then to a
/// start position that rotates on every decision and begins at this client's share of
/// the engines (`num_engines * client_index // client_count`).
#[pyclass(module = "corewire._native", name = "Router")]
pub struct Router {
    inner: CoreRouter,
}

#[pymethods]
impl Router {
    #[new]
    #[pyo3(signature = (num_engines, client_index = 0, client_count = 1))]
    fn new(num_engines: usize, client_index: usize, client_count: usize) -> PyResult<Self> {
        Ok(Router {
            inner: CoreRouter::for_client(num_engines, client_index, client_count)
                .map_err(to_py_err)?,
        })
    }

    /// Front-ends routing over the same engines (the `client_count` it was made with).
    #[getter]
    fn client_count(&self) -> u64 {
        self.inner.clients()
    }

    /// Number of engines routed over.
    #[getter]
    fn num_engines(&self) -> usize {
        self.inner.num_engines()
    }

    /// The least-loaded engine index; notes one request sent to it.
    fn choose(&mut self) -> usize {
        self.inner.choose()
    }

    /// `rank` when it is not None (an explicit `data_parallel_rank` wins, checked against
    /// the engine count), else `choose()`; notes one request sent either way.
    #[pyo3(signature = (rank))]
    fn route(&mut self, rank: Option<i64>) -> PyResult<usize> {
        self.inner.route(rank).map_err(to_py_err)
    }

    /// Notes `count` requests sent to `engine` without a routing decision.
    #[pyo3(signature = (engine, count = 1))]
    fn note_sent(&mut self, engine: i64, count: u32) -> PyResult<()> {
        self.inner.note_sent(engine, count).map_err(to_py_err)
    }

    /// Notes `count` of this client's requests on `engine` finished (never below zero;
    /// engines removed by a resize are ignored).
    #[pyo3(signature = (engine, count = 1))]
    fn note_finished(&mut self, engine: i64, count: u32) {
        self.inner.note_finished(engine, count)
    }

    /// Replaces the coordinator's counts: one `[waiting, running]` pair (any sequence of
    /// two non-negative ints) per engine in rank order. Missing engines read as idle,
    /// extra entries are ignored.
    fn update_counts(&mut self, counts: Vec<[u32; 2]>) {
        self.inner.update_counts(
            counts
                .into_iter()
                .map(|[waiting, running]| (waiting, running)),
        )
    }

    /// Takes `engine` out of routing (`out=True`: a lost engine, never chosen while another
    /// is in, an explicit rank naming it a `ValueError`) or puts it back (`out=False`: its
    /// replacement, idle). Its counts start from zero either way.
    #[pyo3(signature = (engine, out))]
    fn set_out(&mut self, engine: i64, out: bool) -> PyResult<()> {
        self.inner.set_out(engine, out).map_err(to_py_err)
    }

    /// The engines out of routing, in index order.
    fn out_engines(&self) -> Vec<usize> {
        self.inner.out_engines()
    }

    /// Grows (new engines idle) or shrinks (their state dropped) to `num_engines`.
    fn resize(&mut self, num_engines: usize) -> PyResult<()> {
        self.inner.resize(num_engines).map_err(to_py_err)
    }

    /// This client's in-flight request count per engine.
    fn in_flight(&self) -> Vec<u32> {
        self.inner.in_flight()
    }

    /// The load each routing decision compares, per engine.
    fn loads(&self) -> Vec<u64> {
        self.inner.loads()
    }

    /// The coordinator's last `(waiting, running)` counts per engine.
    fn counts(&self) -> Vec<(u32, u32)> {
        self.inner.counts()
    }

    fn __repr__(&self) -> String {
        format!(
            "Router(num_engines={}, in_flight={:?})",
            self.inner.num_engines(),
            self.inner.in_flight()
        )
    }
}
