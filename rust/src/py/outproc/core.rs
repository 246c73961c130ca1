//! `OutputCore`: the processor's native half and its chunk loop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use tokenizers::Tokenizer;

use crate::core::text::decoder::TextDecoder;
use crate::core::text::output::{OutputText, StopRules};
use crate::core::text::stops::StopString;
use crate::core::text::stream::DecodeStream;
use crate::core::wire::{OutputField, WireStruct};
use crate::py::objects::{output_field, output_fields, OutputFields};

use super::names::Names;
use super::request::{ChunkStats, RequestText, FINAL_ONLY};
use super::samples::SampleLogprobs;
use super::shared::{Layout, Shared, COMPLETION_FIELDS, REQUEST_OUTPUT_FIELDS};

/// The processor's native half (see the module doc).
#[pyclass(module = "corewire._native", name = "OutputCore")]
pub struct OutputCore {
    shared: Arc<Shared>,
    /// vLLM's `OutputProcessor.request_states` (the same dict object).
    request_states: Py<PyDict>,
    /// Outputs handled here; outputs of native requests left to vLLM's loop; outputs
    /// of other requests.
    fast: u64,
    slow: u64,
    fallback: u64,
    /// vLLM 0.33.0's stop-string rule for every request (`StopRules::earliest`).
    earliest_stop: bool,
}

#[pymethods]
impl OutputCore {
    /// A processor over `tokenizer_json` (the tokenizer's own JSON: vLLM's detokenizer
    /// uses that same tokenizer). `added` maps added-token ids to their content;
    /// `single_string(id)` gives a logprob candidate's string as vLLM makes it;
    /// `python_decode(ids)`, when given, decodes candidate corrections in Python (for
    /// tokenizers whose Python decode differs from the crate's); `warn(msg)` logs;
    /// `classes` are vLLM's `(RequestOutput, CompletionOutput, Logprob, FlatLogprobs)`,
    /// `layouts` the attributes of its `RequestOutput` and `CompletionOutput` in
    /// `__init__`'s order (a name the native path does not know is a `ValueError`),
    /// `slow_fields` the `EngineCoreOutput` fields that send an output to vLLM's loop when
    /// set. The release's rules: `earliest_stop` (0.33.0's stop strings, see
    /// `StopRules::earliest`), `empty_delta_slice` (0.33.0's `logprobs[:0]` for a `DELTA`
    /// output without new ids).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokenizer_json, added, single_string, python_decode, warn, classes,
        request_states, layouts, slow_fields, earliest_stop = false, empty_delta_slice = false))]
    fn new(
        py: Python<'_>,
        tokenizer_json: &str,
        added: HashMap<u32, String>,
        single_string: Py<PyAny>,
        python_decode: Option<Py<PyAny>>,
        warn: Py<PyAny>,
        classes: (Py<PyAny>, Py<PyAny>, Py<PyAny>, Py<PyAny>),
        request_states: Py<PyDict>,
        layouts: (Vec<String>, Vec<String>),
        slow_fields: Vec<String>,
        earliest_stop: bool,
        empty_delta_slice: bool,
    ) -> PyResult<Self> {
        let request_output_layout =
            Layout::new(py, "RequestOutput", &layouts.0, &REQUEST_OUTPUT_FIELDS)?;
        let completion_layout =
            Layout::new(py, "CompletionOutput", &layouts.1, &COMPLETION_FIELDS)?;
        let tokenizer: Tokenizer = tokenizer_json
            .parse()
            .map_err(|e| PyValueError::new_err(format!("tokenizer JSON: {e}")))?;
        let vocab = tokenizer.get_vocab_size(true);
        let tokenizer = TextDecoder::new(tokenizer);
        // SAFETY: reading a slot of the static base type.
        let object_new = unsafe {
            let slot = ffi::PyType_GetSlot(&raw mut ffi::PyBaseObject_Type, ffi::Py_tp_new);
            std::mem::transmute::<*mut std::ffi::c_void, Option<ffi::newfunc>>(slot)
        }
        .ok_or_else(|| PyRuntimeError::new_err("object has no tp_new"))?;
        let base_new = py.get_type::<pyo3::types::PyAny>().getattr("__new__")?;
        for cls in [&classes.0, &classes.1, &classes.2, &classes.3] {
            if !cls.bind(py).getattr("__new__")?.is(&base_new) {
                return Err(PyValueError::new_err(format!(
                    "{} has its own __new__",
                    cls.bind(py)
                )));
            }
        }
        Ok(OutputCore {
            shared: Arc::new(Shared {
                tokenizer,
                added: Arc::new(added),
                cache: Mutex::new((0..vocab).map(|_| None).collect()),
                single_string,
                python_decode,
                warn,
                object_new,
                empty: PyTuple::empty(py).unbind(),
                request_output: classes.0,
                completion_output: classes.1,
                logprob: classes.2,
                flat_logprobs: classes.3,
                request_output_layout,
                completion_layout,
                slow_slots: slow_fields
                    .iter()
                    .map(|name| {
                        OutputField::ALL
                            .iter()
                            .copied()
                            .find(|f| f.info().name == name.as_str())
                    })
                    .collect(),
                slow_fields: slow_fields
                    .iter()
                    .map(|f| PyString::intern(py, f).unbind())
                    .collect(),
                empty_delta_slice,
            }),
            earliest_stop,
            request_states,
            fast: 0,
            slow: 0,
            fallback: 0,
        })
    }

    /// The native state of a new request: `stop` (its stop strings: empty without
    /// detokenization), `num_logprobs` (None without sample logprobs), `flat_logprobs`
    /// (an empty vLLM `FlatLogprobs` for requests that asked for it), `output_kind`
    /// (vLLM's number), `stream_interval` (the processor's), `plain_collector` (`queue`
    /// is exactly vLLM's `RequestOutputCollector`), `num_prompt_logprobs` and
    /// `prompt_logprobs` (vLLM's new prompt container), `parent` (the `ParentRequest`
    /// of an n > 1 child), and what its outputs carry.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, external_req_id, prompt, prompt_token_ids, lora_request,
        request_index, output_kind, stream_interval, queue, plain_collector, stats, detokenize,
        skip_special_tokens, spaces_between_special_tokens, stop, min_tokens,
        include_stop_str_in_output, num_logprobs, flat_logprobs = None,
        num_prompt_logprobs = None, prompt_logprobs = None, parent = None))]
    fn request(
        &self,
        py: Python<'_>,
        request_id: Py<PyString>,
        external_req_id: Py<PyAny>,
        prompt: Py<PyAny>,
        prompt_token_ids: Bound<'_, PyAny>,
        lora_request: Py<PyAny>,
        request_index: Py<PyAny>,
        output_kind: u8,
        stream_interval: i64,
        queue: Py<PyAny>,
        plain_collector: bool,
        stats: Option<Py<PyAny>>,
        detokenize: bool,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        stop: Vec<String>,
        min_tokens: usize,
        include_stop_str_in_output: bool,
        num_logprobs: Option<i64>,
        flat_logprobs: Option<Bound<'_, PyAny>>,
        num_prompt_logprobs: Option<i64>,
        prompt_logprobs: Option<Bound<'_, PyAny>>,
        parent: Option<Py<PyAny>>,
    ) -> PyResult<RequestText> {
        let prompt_logprobs = match (num_prompt_logprobs, prompt_logprobs) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(PyValueError::new_err(
                    "num_prompt_logprobs without a prompt_logprobs container",
                ))
            }
            (Some(_), Some(c)) => Some(match c.cast::<PyList>() {
                Ok(list) => SampleLogprobs::Dicts(list.clone().unbind()),
                Err(_) => SampleLogprobs::flat(&c)?,
            }),
        };
        if output_kind > FINAL_ONLY {
            return Err(PyValueError::new_err(format!(
                "unknown output kind {output_kind}"
            )));
        }
        let stream = if detokenize {
            let prompt_ids: Vec<u32> = prompt_token_ids.extract()?;
            Some(DecodeStream::new(
                &prompt_ids,
                skip_special_tokens,
                spaces_between_special_tokens,
                &self.shared.added,
            ))
        } else {
            None
        };
        let rules = StopRules {
            stops: stop.into_iter().map(StopString::new).collect(),
            min_tokens,
            include_in_output: include_stop_str_in_output,
            earliest: self.earliest_stop,
        };
        // The container's first positions are None (the first prompt token's, and from
        // 0.34.0 those before `prompt_logprob_start`): the corrections' context sees them.
        let prompt_context = prompt_logprobs.as_ref().map_or(Vec::new(), |c| {
            vec![None; c.len(py).min(crate::core::text::candidates::MAX_CONTEXT)]
        });
        Ok(RequestText {
            shared: Arc::clone(&self.shared),
            stream,
            text: OutputText::new(rules),
            token_ids: PyList::empty(py).unbind(),
            num_logprobs,
            logprobs: match (num_logprobs, flat_logprobs) {
                (None, _) => None,
                (Some(_), None) => Some(SampleLogprobs::dicts(py)),
                (Some(_), Some(flat)) => Some(SampleLogprobs::flat(&flat)?),
            },
            cumulative: 0.0,
            sampled: Vec::new(),
            num_prompt_logprobs,
            prompt_context,
            prompt_token_id_logprobs: None,
            weight_version: None,
            prompt_logprobs,
            request_id,
            external_req_id,
            parent,
            prompt,
            prompt_token_ids: prompt_token_ids.unbind(),
            lora_request,
            request_index,
            output_kind,
            stream_interval,
            queue,
            plain_collector,
            stats,
            sink: None,
            streamed_tokens: 0,
            stream_text_offset: 0,
        })
    }

    /// Handles the chunk's outputs that need nothing of vLLM's bookkeeping, and returns
    /// the outputs left for vLLM's loop, in order. `finish(req_id)` is called for a
    /// request that a stop string finished here, right after its output went to its
    /// collector (where vLLM's loop finishes it: the caller does what vLLM does then,
    /// in the engine's order, which an n > 1 parent's stats depend on). `nans` is
    /// vLLM's `VLLM_COMPUTE_NANS_IN_LOGITS`, read once per chunk. `weight_version`
    /// (0.33.0 on): the engine's weight version for this step's outputs, tracked per
    /// request as vLLM's `RequestState.track_weight_version` does.
    #[pyo3(signature = (outputs, timestamp, iteration_stats, nans, finish, weight_version = None))]
    #[allow(clippy::too_many_arguments)]
    fn process<'py>(
        &mut self,
        py: Python<'py>,
        outputs: &Bound<'py, PyAny>,
        timestamp: Option<f64>,
        iteration_stats: Option<Bound<'py, PyAny>>,
        nans: bool,
        finish: &Bound<'py, PyAny>,
        weight_version: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let names = Names::get(py);
        let rest = PyList::empty(py);
        let mut chunk = match (iteration_stats, timestamp) {
            (Some(stats), Some(timestamp)) => Some(ChunkStats {
                latencies: stats
                    .getattr(&names.inter_token_latencies_iter)?
                    .cast_into()?,
                stats,
                timestamp,
                nans,
                generated: 0,
            }),
            (Some(_), None) => {
                return Err(PyValueError::new_err("iteration stats without a timestamp"))
            }
            _ => None,
        };
        let states = self.request_states.bind(py);
        // First which path each output takes, then the outputs in order: the native
        // ones are handled here, the others left for vLLM's loop, which runs after.
        let mut routes = Vec::new();
        // The parents (n > 1) with an output for vLLM's loop in this chunk: their
        // children share one collector, where the order of the outputs shows, so every
        // output of theirs in the chunk goes that way, in order.
        let mut parents_in_loop: Vec<*mut pyo3::ffi::PyObject> = Vec::new();
        for output in outputs.try_iter()? {
            let output = output?;
            let fields = output_fields(&output);
            let req_id = output_field(
                &output,
                fields.as_ref(),
                OutputField::RequestId,
                &names.request_id,
            )?;
            let Some(req_state) = states.get_item(&req_id)? else {
                routes.push(Route::Fallback(output)); // vLLM's loop drops it: aborted
                continue;
            };
            let detok = req_state.getattr(&names.detokenizer)?;
            let Ok(text) = detok.cast_into::<RequestText>() else {
                routes.push(Route::Fallback(output));
                continue;
            };
            let parent = text.borrow().parent.as_ref().map(|p| p.as_ptr());
            if !plain(&output, fields.as_ref(), &req_state, names, &self.shared)? {
                // vLLM's loop makes this output, for Python to render: the frames of the
                // request's fast path go out before it.
                text.borrow_mut().release_stream(py);
                parents_in_loop.extend(parent);
                routes.push(Route::Slow(output));
                continue;
            }
            routes.push(Route::Fast {
                output,
                req_id,
                req_state,
                text,
                parent,
            });
        }
        // The requests on the fast path with frames to write once the chunk is done.
        let mut streams: Vec<Bound<'py, RequestText>> = Vec::new();
        for route in routes {
            match route {
                Route::Fallback(output) => {
                    rest.append(output)?;
                    self.fallback += 1;
                }
                Route::Slow(output) => {
                    rest.append(output)?;
                    self.slow += 1;
                }
                Route::Fast {
                    output,
                    text,
                    parent: Some(p),
                    ..
                } if parents_in_loop.contains(&p) => {
                    // Python renders this one too: the sample's own frames go first.
                    text.borrow_mut().release_stream(py);
                    rest.append(output)?;
                    self.slow += 1;
                }
                Route::Fast {
                    output,
                    req_id,
                    req_state,
                    text,
                    ..
                } => {
                    let stopped = text.borrow_mut().fast_output(
                        py,
                        &output,
                        &req_state,
                        chunk.as_mut(),
                        weight_version.as_ref(),
                    )?;
                    self.fast += 1;
                    if text.borrow().stream_pending() {
                        streams.push(text);
                    }
                    if stopped {
                        finish.call1((req_id,))?;
                    }
                }
            }
        }
        // One write per stream for the whole chunk.
        for text in streams {
            text.borrow_mut().flush_stream(py);
        }
        if let Some(c) = chunk {
            if c.generated > 0 {
                let total = c
                    .stats
                    .getattr(&names.num_generation_tokens)?
                    .extract::<i64>()?;
                c.stats
                    .setattr(&names.num_generation_tokens, total + c.generated)?;
            }
        }
        Ok(rest)
    }

    /// Whether decodes go through the per-id byte table (byte-level tokenizers).
    #[getter]
    fn byte_table(&self) -> bool {
        self.shared.tokenizer.uses_byte_table()
    }

    /// `{"fast": .., "slow": .., "fallback": ..}`: outputs by path (see the fields).
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("fast", self.fast)?;
        d.set_item("slow", self.slow)?;
        d.set_item("fallback", self.fallback)?;
        Ok(d)
    }
}

/// Which path an output of a chunk takes (see `OutputCore::process`).
enum Route<'py> {
    /// Not a native request's: vLLM's loop.
    Fallback(Bound<'py, PyAny>),
    /// A native request's output that needs vLLM's bookkeeping: vLLM's loop.
    Slow(Bound<'py, PyAny>),
    /// A plain output of a native request: handled natively, unless its parent has an
    /// output in vLLM's loop in the same chunk.
    Fast {
        output: Bound<'py, PyAny>,
        req_id: Bound<'py, PyAny>,
        req_state: Bound<'py, PyAny>,
        text: Bound<'py, RequestText>,
        parent: Option<*mut pyo3::ffi::PyObject>,
    },
}

/// Whether an output is a plain step of a request past its first output: nothing in it
/// needs vLLM's bookkeeping (none of `slow`, the release's fields such as the finish,
/// events, pooling, KV transfer, experts, prompt logprobs, is set). `fields`: the
/// output's fields read in place, where it is the decoder's own.
fn plain(
    output: &Bound<'_, PyAny>,
    fields: Option<&OutputFields<'_, '_>>,
    req_state: &Bound<'_, PyAny>,
    n: &Names,
    shared: &Shared,
) -> PyResult<bool> {
    let py = output.py();
    match (fields, &shared.slow_slots) {
        (Some(fields), Some(slots)) => {
            if !slots.iter().all(|&slot| fields.is_none(slot)) {
                return Ok(false);
            }
        }
        _ => {
            for name in &shared.slow_fields {
                if !output.getattr(name.bind(py))?.is_none() {
                    return Ok(false);
                }
            }
        }
    }
    // 0.33.0 on: a request with sampling masks gathered makes its next output carry
    // them (vLLM's loop builds them).
    if shared.completion_layout.has(9) && req_state.getattr(&n.sampling_mask_chunks)?.len()? > 0 {
        return Ok(false);
    }
    Ok(!req_state.getattr(&n.is_prefilling)?.is_truthy()?)
}
