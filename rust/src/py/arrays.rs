//! Reading the small numeric arrays of logprobs (a position's candidate ids, their
//! logprobs, the sampled token's rank) without a Python call per array: a numpy array's
//! memory is read through its struct fields; anything else goes through `tolist()` or
//! iteration, as vLLM's own `tolist()` calls would see it.

use std::ffi::c_char;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::consts::Consts;
use super::ffi::{NdArrayFields, NPY_ARRAY_C_CONTIGUOUS};

/// The leading fields of numpy's `PyArray_Descr`, the same in numpy 1.x and 2.x.
#[repr(C)]
struct DescrHead {
    ob_base: pyo3::ffi::PyObject,
    typeobj: *mut pyo3::ffi::PyTypeObject,
    kind: c_char,
    type_char: c_char,
    byteorder: c_char,
}

/// A 1- or 2-dimensional block of numbers, row by row.
#[derive(Debug, Default)]
pub struct Block<T> {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<T>,
}

impl<T: Copy> Block<T> {
    /// Row `r` (a 1-dimensional block is one value per row).
    pub fn row(&self, r: usize) -> &[T] {
        &self.values[r * self.cols..(r + 1) * self.cols]
    }
}

/// A number read from an array element.
pub trait Number: Copy + Default {
    /// From a signed integer element.
    fn from_i64(v: i64) -> Self;
    /// From a floating-point element.
    fn from_f64(v: f64) -> Self;
    /// From a Python number (the `tolist()` path).
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self>;
}

impl Number for i64 {
    fn from_i64(v: i64) -> Self {
        v
    }
    fn from_f64(v: f64) -> Self {
        v as i64
    }
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        obj.extract()
    }
}

impl Number for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        obj.extract()
    }
}

/// Reads `obj` (a numpy array of up to two dimensions, a sequence of 1-dimensional
/// arrays, or nested lists) as a block. A 0- or 1-dimensional array is one column.
pub fn block<T: Number>(obj: &Bound<'_, PyAny>) -> PyResult<Block<T>> {
    if let Some(b) = numpy_block(obj)? {
        return Ok(b);
    }
    // A list of per-position arrays (or a plain nested list): row by row.
    let mut out = Block {
        rows: 0,
        cols: 0,
        values: Vec::new(),
    };
    for item in obj.try_iter()? {
        let item = item?;
        let row: Vec<T> = if let Some(b) = numpy_block::<T>(&item)? {
            b.values
        } else if let Ok(seq) = item.try_iter() {
            seq.map(|v| v.and_then(|v| T::extract(&v)))
                .collect::<PyResult<_>>()?
        } else {
            vec![T::extract(&item)?]
        };
        if out.rows == 0 {
            out.cols = row.len();
        } else if row.len() != out.cols {
            // vLLM's arrays are rectangular; anything else is refused plainly.
            return Err(pyo3::exceptions::PyValueError::new_err(
                "logprobs rows of different lengths",
            ));
        }
        out.values.extend(row);
        out.rows += 1;
    }
    Ok(out)
}

fn numpy_block<T: Number>(obj: &Bound<'_, PyAny>) -> PyResult<Option<Block<T>>> {
    let py = obj.py();
    let np = &Consts::get(py)?.numpy;
    let ptr = obj.as_ptr();
    // SAFETY: a type check of a live object.
    if unsafe { pyo3::ffi::PyObject_TypeCheck(ptr, np.array_type()) } == 0 {
        return Ok(None);
    }
    // SAFETY: `obj` is an ndarray, whose struct starts with these fields (ffi.rs).
    let (data, nd, dims, flags, descr) = unsafe {
        let f = &*ptr.cast::<NdArrayFields>();
        (
            f.data,
            f.nd,
            f.dimensions,
            f.flags,
            f.descr.cast::<DescrHead>(),
        )
    };
    if nd > 2 || flags & NPY_ARRAY_C_CONTIGUOUS == 0 {
        return Ok(None);
    }
    // SAFETY: a live array's descriptor and dimensions.
    let (type_char, byteorder, shape) = unsafe {
        let d = &*descr;
        let shape: Vec<usize> = (0..nd as usize)
            .map(|i| (*dims.add(i)).max(0) as usize)
            .collect();
        (d.type_char as u8, d.byteorder as u8, shape)
    };
    // Foreign byte order ('>' here) goes the slow way.
    if !matches!(byteorder, b'=' | b'|' | b'<') {
        return Ok(None);
    }
    let (rows, cols) = match shape.as_slice() {
        [] => (1, 1),
        [n] => (*n, 1),
        [r, c] => (*r, *c),
        _ => unreachable!(),
    };
    let n = rows * cols;
    // Element by element, without assuming alignment: an array viewing a received frame
    // can start at any byte.
    macro_rules! read {
        ($t:ty, $conv:ident) => {{
            let base = data.cast::<$t>();
            (0..n)
                // SAFETY: a C-contiguous array of `n` elements of this type.
                .map(|i| T::$conv(unsafe { base.add(i).read_unaligned() } as _))
                .collect()
        }};
    }
    let values: Vec<T> = match type_char {
        b'b' => read!(i8, from_i64),
        b'h' => read!(i16, from_i64),
        b'i' => read!(i32, from_i64),
        b'l' | b'q' => read!(i64, from_i64),
        b'B' => read!(u8, from_i64),
        b'H' => read!(u16, from_i64),
        b'I' => read!(u32, from_i64),
        b'f' => read!(f32, from_f64),
        b'd' => read!(f64, from_f64),
        _ => return Ok(None),
    };
    Ok(Some(Block { rows, cols, values }))
}

/// `obj[i]` of a tuple (named tuples included) or any sequence.
pub fn item<'py>(obj: &Bound<'py, PyAny>, i: usize) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.get_item(i);
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l.get_item(i);
    }
    obj.get_item(i)
}
