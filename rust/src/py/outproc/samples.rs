//! A request's sample logprobs as vLLM keeps them: a list of position dicts
//! (`{token_id: Logprob}`), or, for `flat_logprobs`, vLLM's `FlatLogprobs`, whose six
//! flat lists are appended to here directly.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyList};
use pyo3::IntoPyObjectExt;

use super::names::Names;
use super::shared::{untrack, Shared};

/// One candidate of a position: token id, logprob, rank and decoded string (None
/// without detokenization).
pub(super) struct Candidate<'py> {
    pub(super) id: i64,
    pub(super) logprob: f64,
    pub(super) rank: i64,
    pub(super) decoded: Bound<'py, PyAny>,
}

/// A `FlatLogprobs` and its six lists, each taken from it once (vLLM never replaces
/// them, so appending to these is appending to the object's own).
pub(super) struct FlatLists {
    object: Py<PyAny>,
    start_indices: Py<PyList>,
    end_indices: Py<PyList>,
    token_ids: Py<PyList>,
    logprobs: Py<PyList>,
    ranks: Py<PyList>,
    decoded_tokens: Py<PyList>,
}

impl FlatLists {
    /// `FlatLogprobs.__getitem__` of the positions `start..end` (not empty): a new
    /// `FlatLogprobs` of copies of their entries, its indices shifted to start at 0.
    fn slice<'py>(
        &self,
        py: Python<'py>,
        shared: &Shared,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let names = Names::get(py);
        let index = |list: &Py<PyList>, i: usize| -> PyResult<i64> {
            list.bind(py).get_item(i)?.extract::<i64>()
        };
        let first = index(&self.start_indices, start)?;
        let last = index(&self.end_indices, end - 1)?;
        let shifted = |list: &Py<PyList>| -> PyResult<Bound<'py, PyAny>> {
            let out = PyList::empty(py);
            for i in start..end {
                out.append(index(list, i)? - first)?;
            }
            Ok(out.into_any())
        };
        let entries = |list: &Py<PyList>| -> PyResult<Bound<'py, PyAny>> {
            let (lo, hi) = (usize::try_from(first), usize::try_from(last));
            match (lo, hi) {
                (Ok(lo), Ok(hi)) => Ok(list.bind(py).get_slice(lo, hi).into_any()),
                _ => Err(PyValueError::new_err("FlatLogprobs with a negative index")),
            }
        };
        shared.instance(
            py,
            &shared.flat_logprobs,
            &[
                (&names.start_indices, shifted(&self.start_indices)?),
                (&names.end_indices, shifted(&self.end_indices)?),
                (&names.token_ids, entries(&self.token_ids)?),
                (&names.logprobs, entries(&self.logprobs)?),
                (&names.ranks, entries(&self.ranks)?),
                (&names.decoded_tokens, entries(&self.decoded_tokens)?),
            ],
        )
    }
}

/// The container (see the module doc).
pub(super) enum SampleLogprobs {
    Dicts(Py<PyList>),
    Flat(FlatLists),
}

impl SampleLogprobs {
    /// A new list of position dicts.
    pub(super) fn dicts(py: Python<'_>) -> Self {
        SampleLogprobs::Dicts(PyList::empty(py).unbind())
    }

    /// Over a `FlatLogprobs` made by vLLM (`create_sample_logprobs(True)`, empty, or
    /// `create_prompt_logprobs(True)`, holding the first prompt token's None position).
    pub(super) fn flat(object: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = object.py();
        let names = Names::get(py);
        let list = |name: &Py<pyo3::types::PyString>| -> PyResult<Py<PyList>> {
            Ok(object
                .getattr(name.bind(py))?
                .cast_into::<PyList>()?
                .unbind())
        };
        Ok(SampleLogprobs::Flat(FlatLists {
            object: object.clone().unbind(),
            start_indices: list(&names.start_indices)?,
            end_indices: list(&names.end_indices)?,
            token_ids: list(&names.token_ids)?,
            logprobs: list(&names.logprobs)?,
            ranks: list(&names.ranks)?,
            decoded_tokens: list(&names.decoded_tokens)?,
        }))
    }

    /// The container itself, as vLLM's `LogprobsProcessor.logprobs` holds it.
    pub(super) fn object<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        match self {
            SampleLogprobs::Dicts(list) => list.bind(py).clone().into_any(),
            SampleLogprobs::Flat(flat) => flat.object.bind(py).clone(),
        }
    }

    /// The number of positions.
    pub(super) fn len(&self, py: Python<'_>) -> usize {
        match self {
            SampleLogprobs::Dicts(list) => list.bind(py).len(),
            SampleLogprobs::Flat(flat) => flat.start_indices.bind(py).len(),
        }
    }

    /// Python's `container[-k:]` for a `DELTA` output of `k` tokens (`k == 0` is the
    /// whole container, as `[-0:]` is), of a non-empty container.
    pub(super) fn tail<'py>(
        &self,
        py: Python<'py>,
        shared: &Shared,
        k: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let len = self.len(py);
        let start = if k == 0 { 0 } else { len.saturating_sub(k) };
        match self {
            SampleLogprobs::Dicts(list) => Ok(list.bind(py).get_slice(start, len).into_any()),
            SampleLogprobs::Flat(flat) => flat.slice(py, shared, start, len),
        }
    }

    /// Appends one position (`Logprob` objects made through `shared` for dicts).
    pub(super) fn push<'py>(
        &self,
        py: Python<'py>,
        shared: &Shared,
        candidates: impl Iterator<Item = PyResult<Candidate<'py>>>,
    ) -> PyResult<()> {
        match self {
            SampleLogprobs::Dicts(list) => {
                let names = Names::get(py);
                let position = PyDict::new(py);
                for c in candidates {
                    let c = c?;
                    let value = shared.instance(
                        py,
                        &shared.logprob,
                        &[
                            (&names.logprob, PyFloat::new(py, c.logprob).into_any()),
                            (&names.rank, c.rank.into_bound_py_any(py)?),
                            (&names.decoded_token, c.decoded),
                        ],
                    )?;
                    untrack(&value);
                    // Later duplicates of an id replace its value in place, as in a
                    // Python dict display.
                    position.set_item(c.id, value)?;
                }
                // Keys are ints and values untracked Logprobs: no cycle can pass through
                // the dict (CPython tracks it again if a container is ever stored in it).
                untrack(&position);
                list.bind(py).append(position)
            }
            SampleLogprobs::Flat(flat) => {
                // Every candidate is made before anything is appended, so that a failure
                // leaves the six lists aligned (as vLLM's decodes come before its
                // `append_fast`); every candidate is kept, duplicates too.
                let candidates = candidates.collect::<PyResult<Vec<_>>>()?;
                let values = flat.logprobs.bind(py);
                flat.start_indices.bind(py).append(values.len())?;
                for c in candidates {
                    flat.token_ids.bind(py).append(c.id)?;
                    values.append(c.logprob)?;
                    flat.ranks.bind(py).append(c.rank)?;
                    flat.decoded_tokens.bind(py).append(c.decoded)?;
                }
                flat.end_indices.bind(py).append(values.len())
            }
        }
    }
}
