//! `OutputCore` and `RequestText`: the native side of `corewire.vllm.output`.
//!
//! `RequestText` is one request's detokenizer and sample-logprobs state. It answers the
//! calls vLLM's `RequestState` makes on its `detokenizer` and `logprobs_processor` (the
//! same object stands in for both), so vLLM's own loop can drive it for the outputs that
//! need vLLM's bookkeeping (a request's first output, engine finishes, events).
//! `OutputCore.process` takes every other output of such requests from a chunk and does
//! vLLM 0.25.1's per-output work for them without Python: stats, detokenization, stop
//! strings, logprobs, the `RequestOutput` and its hand-off to the request's collector.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;
use tokenizers::Tokenizer;

use crate::core::text::decoder::TextDecoder;

use crate::core::text::candidates;
use crate::core::text::output::{OutputText, StopRules};
use crate::core::text::stops::StopString;
use crate::core::text::stream::{DecodeStream, StepNote};

use super::arrays::{self, Block};

/// A candidate's string and whether it ends in U+FFFD.
type Candidate = (Py<PyString>, bool);

/// What every request of one processor shares: the tokenizer and vLLM's classes.
struct Shared {
    tokenizer: TextDecoder,
    added: Arc<HashMap<u32, String>>,
    /// Candidate strings by id, filled on first use through `single_string` (vLLM's
    /// own function, so that they are exactly vLLM's), with whether each ends in U+FFFD.
    cache: Mutex<Vec<Option<Candidate>>>,
    single_string: Py<PyAny>,
    /// Python's decode of a run of ids, when the crate's decode may differ from it.
    python_decode: Option<Py<PyAny>>,
    warn: Py<PyAny>,
    /// `object.__new__`'s C function and an empty tuple to call it with: instances made
    /// without a Python call, their attributes set in `__init__`'s order.
    object_new: ffi::newfunc,
    empty: Py<PyTuple>,
    request_output: Py<PyAny>,
    completion_output: Py<PyAny>,
    logprob: Py<PyAny>,
}

impl Shared {
    /// A candidate's own string and whether it ends in U+FFFD.
    fn single<'py>(&self, py: Python<'py>, id: i64) -> PyResult<(Bound<'py, PyString>, bool)> {
        let slot = usize::try_from(id).ok();
        if let Some(i) = slot {
            let cache = self.cache.lock().expect("candidate cache");
            if let Some(Some((s, bad))) = cache.get(i) {
                return Ok((s.bind(py).clone(), *bad));
            }
        }
        // Not under the lock: the call runs Python.
        let s = self
            .single_string
            .bind(py)
            .call1((id,))?
            .cast_into::<PyString>()?;
        let bad = candidates::incomplete(s.to_str()?);
        if let Some(i) = slot {
            let mut cache = self.cache.lock().expect("candidate cache");
            if let Some(entry) = cache.get_mut(i) {
                *entry = Some((s.clone().unbind(), bad));
            }
        }
        Ok((s, bad))
    }

    fn decode(&self, py: Python<'_>, ids: &[u32]) -> PyResult<String> {
        match &self.python_decode {
            Some(f) => f.bind(py).call1((ids.to_vec(),))?.extract(),
            None => self
                .tokenizer
                .decode(ids, false)
                .map_err(|e| PyRuntimeError::new_err(e.0)),
        }
    }

    /// `cls` made without its `__init__`, its instance dict filled in `items`' order (the
    /// order its `__init__` assigns them, which the Python side checked at start-up).
    fn instance<'py>(
        &self,
        py: Python<'py>,
        cls: &Py<PyAny>,
        items: &[(&Py<PyString>, Bound<'py, PyAny>)],
    ) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `cls` is a class whose `__new__` is `object.__new__` (checked when the
        // processor was made); the call takes no arguments.
        let obj = unsafe {
            Bound::from_owned_ptr_or_err(
                py,
                (self.object_new)(
                    cls.as_ptr().cast(),
                    self.empty.as_ptr(),
                    std::ptr::null_mut(),
                ),
            )?
        };
        for (k, v) in items {
            obj.setattr(k.bind(py), v)?;
        }
        Ok(obj)
    }
}

/// Leaves `obj` out of the cyclic collector's scans.
///
/// A request keeps every position's logprobs until it finishes (vLLM's processor does
/// too), so a long stream piles up thousands of `Logprob` objects and dicts; tracked, they
/// make each full collection scan them all, again and again. A `Logprob` holds a float, an
/// int and a string, and can be part of no cycle.
fn untrack(obj: &Bound<'_, PyAny>) {
    // SAFETY: a live GC object; untracking an untracked object is a no-op.
    unsafe {
        if ffi::PyObject_GC_IsTracked(obj.as_ptr()) != 0 {
            ffi::PyObject_GC_UnTrack(obj.as_ptr().cast());
        }
    }
}

/// The `tokenizers` crate release this module decodes with (major.minor; keep in step
/// with Cargo.toml). The Python side compares it with the `tokenizers` package vLLM
/// decodes with, and keeps vLLM's path when they differ.
pub const TOKENIZERS_VERSION: &str = "0.23";

/// Output kinds, as vLLM's `RequestOutputKind` numbers them (0 is `CUMULATIVE`).
const DELTA: u8 = 1;
const FINAL_ONLY: u8 = 2;

/// One request's text, token ids and sample logprobs (see the module doc).
#[pyclass(module = "corewire._native", name = "RequestText")]
pub struct RequestText {
    shared: Arc<Shared>,
    /// `None` when the request asked for no detokenization.
    stream: Option<DecodeStream>,
    text: OutputText,
    token_ids: Py<PyList>,
    num_logprobs: Option<i64>,
    logprobs: Option<Py<PyList>>,
    cumulative: f64,
    /// The sampled ids of the last positions (the context of candidate corrections).
    sampled: Vec<u32>,
    // What the request's outputs carry, fixed when it was added.
    request_id: Py<PyString>,
    external_req_id: Py<PyAny>,
    prompt: Py<PyAny>,
    prompt_token_ids: Py<PyAny>,
    lora_request: Py<PyAny>,
    request_index: Py<PyAny>,
    output_kind: u8,
    queue: Py<PyAny>,
    /// Whether `queue` is exactly vLLM's `RequestOutputCollector` (its `put` is then
    /// done here for the common case, see `hand_off`).
    plain_collector: bool,
    stats: Option<Py<PyAny>>,
}

impl RequestText {
    fn take_ids(&mut self, py: Python<'_>, new_ids: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let list = self.token_ids.bind(py);
        let mut ids = Vec::new();
        let mut take = |id: Bound<'_, PyAny>| -> PyResult<()> {
            // An id that is no int, or out of range, decodes to nothing (as in vLLM).
            ids.push(id.extract::<i64>().unwrap_or(-1));
            list.append(id)
        };
        // Index a list (no iterator object: one allocation less per output).
        if let Ok(new_list) = new_ids.cast::<PyList>() {
            for i in 0..new_list.len() {
                take(new_list.get_item(i)?)?;
            }
        } else {
            for id in new_ids.try_iter()? {
                take(id?)?;
            }
        }
        Ok(ids)
    }

    /// Detokenizes `ids` and checks stop strings: the stop string's index, if one ended
    /// the text.
    fn detokenize(
        &mut self,
        py: Python<'_>,
        ids: &[i64],
        stop_terminated: bool,
    ) -> PyResult<Option<usize>> {
        let shared = &*self.shared;
        let request_id = &self.request_id;
        match self.stream.as_mut() {
            None => self
                .text
                .update::<PyErr>(ids, stop_terminated, |_| Ok(String::new())),
            Some(stream) => self.text.update(ids, stop_terminated, |id| {
                let (piece, note) = stream
                    .next(&shared.tokenizer, id)
                    .map_err(|e| PyRuntimeError::new_err(e.0))?;
                if let Some(note) = note {
                    let msg = match note {
                        StepNote::InvalidId(id) => format!("Encountered invalid token id: {id}"),
                        StepNote::Restarted => format!(
                            "Encountered invalid prefix detokenization error for request {}, \
                             resetting decode stream.",
                            request_id.bind(py)
                        ),
                    };
                    shared.warn.bind(py).call1((msg,))?;
                }
                Ok(piece)
            }),
        }
    }

    /// Appends the positions of an output's `new_logprobs` (a `LogprobsLists`).
    fn add_logprobs(&mut self, py: Python<'_>, lists: &Bound<'_, PyAny>) -> PyResult<()> {
        let (Some(num), Some(store)) = (self.num_logprobs, self.logprobs.as_ref()) else {
            return Err(PyRuntimeError::new_err(
                "logprobs for a request that asked for none",
            ));
        };
        let ids: Block<i64> = arrays::block(&arrays::item(lists, 0)?)?;
        let lps: Block<f64> = arrays::block(&arrays::item(lists, 1)?)?;
        let ranks: Block<i64> = arrays::block(&arrays::item(lists, 2)?)?;
        let store = store.bind(py).clone();
        let shared = Arc::clone(&self.shared);
        let names = Names::get(py);
        let positions = ids.rows.min(lps.rows).min(ranks.rows);
        for p in 0..positions {
            let (ids, lps, rank) = (ids.row(p), lps.row(p), ranks.row(p)[0]);
            let wanted = if num == -1 {
                lps.len()
            } else {
                num.max(0) as usize
            };
            let count = ids.len().min(lps.len()).min(1 + wanted);
            let position = PyDict::new(py);
            for i in 0..count {
                let decoded = if self.stream.is_some() {
                    self.candidate(py, &shared, ids[i])?.into_any()
                } else {
                    py.None().into_bound(py)
                };
                let rank = if i == 0 { rank } else { i as i64 };
                let value = shared.instance(
                    py,
                    &shared.logprob,
                    &[
                        (&names.logprob, PyFloat::new(py, lps[i]).into_any()),
                        (&names.rank, rank.into_bound_py_any(py)?),
                        (&names.decoded_token, decoded),
                    ],
                )?;
                untrack(&value);
                position.set_item(ids[i], value)?;
            }
            // Keys are ints and values untracked Logprobs: no cycle can pass through the
            // dict (CPython tracks it again if a container is ever stored in it).
            untrack(&position);
            store.append(position)?;
            if let Some(&first) = lps.first() {
                self.cumulative += first;
            }
            if let Some(&first) = ids.first() {
                self.sampled.push(u32::try_from(first).unwrap_or(u32::MAX));
                if self.sampled.len() > candidates::MAX_CONTEXT {
                    self.sampled.remove(0);
                }
            }
        }
        Ok(())
    }

    /// A candidate's string at the current position.
    fn candidate<'py>(
        &self,
        py: Python<'py>,
        shared: &Shared,
        id: i64,
    ) -> PyResult<Bound<'py, PyString>> {
        let (s, incomplete) = shared.single(py, id)?;
        if !incomplete {
            return Ok(s);
        }
        let token = u32::try_from(id).map_err(|_| PyValueError::new_err("negative token id"))?;
        let fixed = candidates::correct(
            token,
            &self.sampled,
            |ids| shared.decode(py, ids),
            |t| Ok(shared.single(py, t as i64)?.1),
        )?;
        Ok(PyString::new(py, &fixed))
    }

    fn cumulative_value<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        match self.num_logprobs {
            Some(_) => PyFloat::new(py, self.cumulative).into_any(),
            None => py.None().into_bound(py),
        }
    }
}

#[pymethods]
impl RequestText {
    /// Detokenizer: takes new token ids; returns the stop string that ended the text.
    fn update(
        &mut self,
        py: Python<'_>,
        new_token_ids: &Bound<'_, PyAny>,
        stop_terminated: bool,
    ) -> PyResult<Option<String>> {
        let ids = self.take_ids(py, new_token_ids)?;
        Ok(self
            .detokenize(py, &ids, stop_terminated)?
            .map(|i| self.text.stop(i).to_owned()))
    }

    /// Detokenizer: the text of the next output (see `OutputText::next_output`).
    fn get_next_output_text(&mut self, finished: bool, delta: bool) -> String {
        self.text.next_output(finished, delta).to_owned()
    }

    /// Detokenizer: every output token id so far (the same list each time).
    #[getter]
    fn output_token_ids(&self, py: Python<'_>) -> Py<PyList> {
        self.token_ids.clone_ref(py)
    }

    /// Detokenizer: the number of output token ids so far.
    fn num_output_tokens(&self) -> usize {
        self.text.tokens()
    }

    /// Detokenizer: the output text so far.
    #[getter]
    fn output_text(&self) -> &str {
        self.text.text()
    }

    /// Logprobs processor: takes an output's sample logprobs.
    fn update_from_output(&mut self, py: Python<'_>, output: &Bound<'_, PyAny>) -> PyResult<()> {
        let names = Names::get(py);
        if !output
            .getattr(&names.new_prompt_logprobs_tensors)?
            .is_none()
        {
            return Err(PyRuntimeError::new_err(
                "prompt logprobs reached a request on corewire's native output path",
            ));
        }
        let lists = output.getattr(&names.new_logprobs)?;
        if !lists.is_none() {
            self.add_logprobs(py, &lists)?;
        }
        Ok(())
    }

    /// Logprobs processor: the sample logprobs so far (a list of dicts), or None.
    #[getter]
    fn logprobs(&self, py: Python<'_>) -> Option<Py<PyList>> {
        self.logprobs.as_ref().map(|l| l.clone_ref(py))
    }

    /// Logprobs processor: the sum of the sampled tokens' logprobs, or None.
    #[getter]
    fn cumulative_logprob<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.cumulative_value(py)
    }

    /// Logprobs processor: native requests never ask for prompt logprobs.
    #[getter]
    fn prompt_logprobs(&self) -> Option<Py<PyAny>> {
        None
    }

    /// Logprobs processor: native requests never ask for prompt logprobs.
    fn pop_prompt_logprobs(&self) -> Option<Py<PyAny>> {
        None
    }
}

/// Interned attribute names.
struct Names {
    request_id: Py<PyString>,
    new_token_ids: Py<PyString>,
    finish_reason: Py<PyString>,
    events: Py<PyString>,
    pooling_output: Py<PyString>,
    kv_transfer_params: Py<PyString>,
    routed_experts: Py<PyString>,
    new_logprobs: Py<PyString>,
    new_prompt_logprobs_tensors: Py<PyString>,
    num_nans_in_logits: Py<PyString>,
    detokenizer: Py<PyString>,
    is_prefilling: Py<PyString>,
    num_cached_tokens: Py<PyString>,
    num_generation_tokens: Py<PyString>,
    last_token_ts: Py<PyString>,
    is_corrupted: Py<PyString>,
    inter_token_latencies_iter: Py<PyString>,
    put: Py<PyString>,
    output: Py<PyString>,
    ready: Py<PyString>,
    set: Py<PyString>,
    logprob: Py<PyString>,
    rank: Py<PyString>,
    decoded_token: Py<PyString>,
    // CompletionOutput's fields, in order.
    index: Py<PyString>,
    text: Py<PyString>,
    token_ids: Py<PyString>,
    cumulative_logprob: Py<PyString>,
    logprobs: Py<PyString>,
    stop_reason: Py<PyString>,
    lora_request: Py<PyString>,
    // RequestOutput's fields, in order (those not above).
    prompt: Py<PyString>,
    prompt_token_ids: Py<PyString>,
    prompt_logprobs: Py<PyString>,
    outputs: Py<PyString>,
    finished: Py<PyString>,
    metrics: Py<PyString>,
    encoder_prompt: Py<PyString>,
    encoder_prompt_token_ids: Py<PyString>,
}

static NAMES: pyo3::sync::PyOnceLock<Names> = pyo3::sync::PyOnceLock::new();

impl Names {
    fn get(py: Python<'_>) -> &'static Names {
        NAMES.get_or_init(py, || {
            let n = |s: &str| PyString::intern(py, s).unbind();
            Names {
                request_id: n("request_id"),
                new_token_ids: n("new_token_ids"),
                finish_reason: n("finish_reason"),
                events: n("events"),
                pooling_output: n("pooling_output"),
                kv_transfer_params: n("kv_transfer_params"),
                routed_experts: n("routed_experts"),
                new_logprobs: n("new_logprobs"),
                new_prompt_logprobs_tensors: n("new_prompt_logprobs_tensors"),
                num_nans_in_logits: n("num_nans_in_logits"),
                detokenizer: n("detokenizer"),
                is_prefilling: n("is_prefilling"),
                num_cached_tokens: n("num_cached_tokens"),
                num_generation_tokens: n("num_generation_tokens"),
                last_token_ts: n("last_token_ts"),
                is_corrupted: n("is_corrupted"),
                inter_token_latencies_iter: n("inter_token_latencies_iter"),
                put: n("put"),
                output: n("output"),
                ready: n("ready"),
                set: n("set"),
                logprob: n("logprob"),
                rank: n("rank"),
                decoded_token: n("decoded_token"),
                index: n("index"),
                text: n("text"),
                token_ids: n("token_ids"),
                cumulative_logprob: n("cumulative_logprob"),
                logprobs: n("logprobs"),
                stop_reason: n("stop_reason"),
                lora_request: n("lora_request"),
                prompt: n("prompt"),
                prompt_token_ids: n("prompt_token_ids"),
                prompt_logprobs: n("prompt_logprobs"),
                outputs: n("outputs"),
                finished: n("finished"),
                metrics: n("metrics"),
                encoder_prompt: n("encoder_prompt"),
                encoder_prompt_token_ids: n("encoder_prompt_token_ids"),
            }
        })
    }
}

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
}

/// Per-chunk stats context: vLLM's `IterationStats` and what this chunk adds to it.
struct ChunkStats<'py> {
    stats: Bound<'py, PyAny>,
    latencies: Bound<'py, PyList>,
    timestamp: f64,
    nans: bool,
    generated: i64,
}

#[pymethods]
impl OutputCore {
    /// A processor over `tokenizer_json` (the tokenizer's own JSON: vLLM's detokenizer
    /// uses that same tokenizer). `added` maps added-token ids to their content;
    /// `single_string(id)` gives a logprob candidate's string as vLLM makes it;
    /// `python_decode(ids)`, when given, decodes candidate corrections in Python (for
    /// tokenizers whose Python decode differs from the crate's); `warn(msg)` logs;
    /// `classes` are vLLM's `(RequestOutput, CompletionOutput, Logprob)`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tokenizer_json: &str,
        added: HashMap<u32, String>,
        single_string: Py<PyAny>,
        python_decode: Option<Py<PyAny>>,
        warn: Py<PyAny>,
        classes: (Py<PyAny>, Py<PyAny>, Py<PyAny>),
        request_states: Py<PyDict>,
    ) -> PyResult<Self> {
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
        for cls in [&classes.0, &classes.1, &classes.2] {
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
            }),
            request_states,
            fast: 0,
            slow: 0,
            fallback: 0,
        })
    }

    /// The native state of a new request: `stop` (its stop strings: empty without
    /// detokenization), `num_logprobs` (None without sample logprobs), `output_kind`
    /// (vLLM's number), `plain_collector` (`queue` is exactly vLLM's
    /// `RequestOutputCollector`), and what its outputs carry.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, external_req_id, prompt, prompt_token_ids, lora_request,
        request_index, output_kind, queue, plain_collector, stats, detokenize, skip_special_tokens,
        spaces_between_special_tokens, stop, min_tokens, include_stop_str_in_output,
        num_logprobs))]
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
    ) -> PyResult<RequestText> {
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
        };
        Ok(RequestText {
            shared: Arc::clone(&self.shared),
            stream,
            text: OutputText::new(rules),
            token_ids: PyList::empty(py).unbind(),
            num_logprobs,
            logprobs: num_logprobs.map(|_| PyList::empty(py).unbind()),
            cumulative: 0.0,
            sampled: Vec::new(),
            request_id,
            external_req_id,
            prompt,
            prompt_token_ids: prompt_token_ids.unbind(),
            lora_request,
            request_index,
            output_kind,
            queue,
            plain_collector,
            stats,
        })
    }

    /// Handles the chunk's outputs that need nothing of vLLM's bookkeeping, and returns
    /// `(rest, stopped)`: the outputs left for vLLM's loop, in order, and the ids of
    /// requests that a stop string finished here (the caller finishes them as vLLM
    /// does). `nans` is vLLM's `VLLM_COMPUTE_NANS_IN_LOGITS`, read once per chunk.
    #[pyo3(signature = (outputs, timestamp, iteration_stats, nans))]
    fn process<'py>(
        &mut self,
        py: Python<'py>,
        outputs: &Bound<'py, PyAny>,
        timestamp: Option<f64>,
        iteration_stats: Option<Bound<'py, PyAny>>,
        nans: bool,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let names = Names::get(py);
        let rest = PyList::empty(py);
        let stopped = PyList::empty(py);
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
        for output in outputs.try_iter()? {
            let output = output?;
            let req_id = output.getattr(&names.request_id)?;
            let Some(req_state) = states.get_item(&req_id)? else {
                rest.append(output)?; // vLLM's loop drops it: already aborted
                self.fallback += 1;
                continue;
            };
            let detok = req_state.getattr(&names.detokenizer)?;
            let Ok(text) = detok.cast::<RequestText>() else {
                rest.append(output)?;
                self.fallback += 1;
                continue;
            };
            if !plain(&output, &req_state, names)? {
                rest.append(output)?;
                self.slow += 1;
                continue;
            }
            let mut text = text.borrow_mut();
            if text.fast_output(py, &output, &req_state, chunk.as_mut())? {
                stopped.append(req_id)?;
            }
            self.fast += 1;
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
        Ok((rest, stopped))
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

/// Whether an output is a plain step of a request past its first output: nothing in it
/// needs vLLM's bookkeeping (finish, events, prefill, pooling, KV transfer, experts).
fn plain(output: &Bound<'_, PyAny>, req_state: &Bound<'_, PyAny>, n: &Names) -> PyResult<bool> {
    let py = output.py();
    for name in [
        &n.finish_reason,
        &n.events,
        &n.pooling_output,
        &n.kv_transfer_params,
        &n.routed_experts,
        &n.new_prompt_logprobs_tensors,
    ] {
        if !output.getattr(name.bind(py))?.is_none() {
            return Ok(false);
        }
    }
    Ok(!req_state.getattr(&n.is_prefilling)?.is_truthy()?)
}

impl RequestText {
    /// vLLM's per-output work for a plain output (see `plain`); true when a stop string
    /// finished the request.
    fn fast_output<'py>(
        &mut self,
        py: Python<'py>,
        output: &Bound<'py, PyAny>,
        req_state: &Bound<'py, PyAny>,
        chunk: Option<&mut ChunkStats<'py>>,
    ) -> PyResult<bool> {
        let names = Names::get(py);
        let new_ids = output.getattr(&names.new_token_ids)?;
        // 1) Stats, as IterationStats.update_from_output does for a request past its
        //    first token.
        if let Some(c) = chunk {
            let stats = self
                .stats
                .as_ref()
                .ok_or_else(|| PyRuntimeError::new_err("stats logged but none kept"))?
                .bind(py);
            let n = new_ids.len()? as i64;
            c.generated += n;
            let had = stats
                .getattr(&names.num_generation_tokens)?
                .extract::<i64>()?;
            stats.setattr(&names.num_generation_tokens, had + n)?;
            if c.nans
                && !stats.getattr(&names.is_corrupted)?.is_truthy()?
                && output
                    .getattr(&names.num_nans_in_logits)?
                    .extract::<i64>()?
                    > 0
            {
                stats.setattr(&names.is_corrupted, true)?;
            }
            let last = stats.getattr(&names.last_token_ts)?.extract::<f64>()?;
            c.latencies.append(c.timestamp - last)?;
            stats.setattr(&names.last_token_ts, c.timestamp)?;
        }
        // 2) Detokenize and check stop strings; 3) sample logprobs.
        let ids = self.take_ids(py, &new_ids)?;
        let stop = self.detokenize(py, &ids, false)?;
        let lists = output.getattr(&names.new_logprobs)?;
        if !lists.is_none() {
            self.add_logprobs(py, &lists)?;
        }
        // 4) The RequestOutput, to the request's collector.
        let finished = stop.is_some();
        if finished || self.output_kind != FINAL_ONLY {
            let out = self.request_output(py, req_state, &new_ids, stop)?;
            self.hand_off(py, out)?;
        }
        Ok(finished)
    }

    /// `queue.put(out)`. For vLLM's own collector with nothing waiting in it, that is
    /// storing the output and setting the ready event, done here without the Python
    /// frame of `put`; merging into a waiting output stays with `put`.
    fn hand_off<'py>(&self, py: Python<'py>, out: Bound<'py, PyAny>) -> PyResult<()> {
        let names = Names::get(py);
        let queue = self.queue.bind(py);
        if self.plain_collector && queue.getattr(&names.output)?.is_none() {
            queue.setattr(&names.output, out)?;
            queue.getattr(&names.ready)?.call_method0(&names.set)?;
            return Ok(());
        }
        queue.call_method1(&names.put, (out,))?;
        Ok(())
    }

    /// The `RequestOutput` of a plain output, as vLLM's `RequestState` makes it.
    fn request_output<'py>(
        &mut self,
        py: Python<'py>,
        req_state: &Bound<'py, PyAny>,
        new_ids: &Bound<'py, PyAny>,
        stop: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = Names::get(py);
        let finished = stop.is_some();
        let delta = self.output_kind == DELTA;
        let text = PyString::new(py, self.text.next_output(finished, delta)).into_any();
        let token_ids = if delta {
            new_ids.clone()
        } else {
            self.token_ids.bind(py).clone().into_any()
        };
        let logprobs = match &self.logprobs {
            None => py.None().into_bound(py),
            Some(all) => {
                let all = all.bind(py);
                let len = all.len();
                if delta && len > 0 {
                    // Python's all[-k:], where k == 0 means the whole list.
                    let k = token_ids.len()?;
                    let start = if k == 0 { 0 } else { len.saturating_sub(k) };
                    all.get_slice(start, len).into_any()
                } else {
                    all.clone().into_any()
                }
            }
        };
        let none = || py.None().into_bound(py);
        let (reason, stop_reason) = match stop {
            Some(i) => (
                PyString::new(py, "stop").into_any(),
                PyString::new(py, self.text.stop(i)).into_any(),
            ),
            None => (none(), none()),
        };
        let shared = &*self.shared;
        let completion = shared.instance(
            py,
            &shared.completion_output,
            &[
                (&n.index, self.request_index.bind(py).clone()),
                (&n.text, text),
                (&n.token_ids, token_ids),
                (&n.cumulative_logprob, self.cumulative_value(py)),
                (&n.logprobs, logprobs),
                (&n.routed_experts, none()),
                (&n.finish_reason, reason),
                (&n.stop_reason, stop_reason),
                (&n.lora_request, none()),
            ],
        )?;
        let metrics = match &self.stats {
            Some(s) => s.bind(py).clone(),
            None => none(),
        };
        shared.instance(
            py,
            &shared.request_output,
            &[
                (&n.request_id, self.external_req_id.bind(py).clone()),
                (&n.prompt, self.prompt.bind(py).clone()),
                (&n.prompt_token_ids, self.prompt_token_ids.bind(py).clone()),
                (&n.prompt_logprobs, none()),
                (&n.outputs, PyList::new(py, [completion])?.into_any()),
                (&n.finished, finished.into_bound_py_any(py)?),
                (&n.metrics, metrics),
                (&n.lora_request, self.lora_request.bind(py).clone()),
                (&n.encoder_prompt, none()),
                (&n.encoder_prompt_token_ids, none()),
                (
                    &n.num_cached_tokens,
                    req_state.getattr(&n.num_cached_tokens)?,
                ),
                (&n.kv_transfer_params, none()),
            ],
        )
    }
}
