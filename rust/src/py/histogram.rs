//! `fold_observations`: a run of Prometheus histogram observations in one call (the
//! binding of [`crate::core::histogram::fold`]).

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyList};

/// What observing each of `values` in order, with `prometheus_client`'s
/// `Histogram.observe`, does to a histogram whose sum is `sum` and whose buckets have the
/// upper bounds `bounds`: `(new_sum, gained_per_bucket)`. The sum has the bits the calls
/// would leave (the same additions, in order). A value that is not a number raises
/// `TypeError` with nothing computed.
#[pyfunction]
pub fn fold_observations(
    values: &Bound<'_, PyList>,
    sum: f64,
    bounds: Vec<f64>,
) -> PyResult<(f64, Vec<u64>)> {
    let mut numbers = Vec::with_capacity(values.len());
    for value in values.iter() {
        // Floats are what vLLM appends; an int is what a caller might.
        let number = match value.cast::<PyFloat>() {
            Ok(float) => float.value(),
            Err(_) => value.extract::<f64>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "an observation must be a number, not {}",
                    value
                        .get_type()
                        .name()
                        .map_or_else(|_| "?".into(), |n| n.to_string())
                ))
            })?,
        };
        numbers.push(number);
    }
    Ok(crate::core::histogram::fold(numbers, sum, &bounds))
}
