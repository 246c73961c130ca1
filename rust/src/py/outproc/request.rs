//! `RequestText`: one request's native state, and vLLM's per-output work on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyList, PySlice, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::core::text::candidates;
use crate::core::text::output::OutputText;
use crate::core::text::stream::{DecodeStream, StepNote};
use crate::core::wire::OutputField;

use super::names::Names;
use super::samples::{Candidate, SampleLogprobs};
use super::shared::{Shared, COMPLETION_FIELDS, REQUEST_OUTPUT_FIELDS};
use super::sink::{Flushed, PositionEntries, StreamSink};
use crate::core::sse::{FrameTemplate, UsageHoles};
use crate::py::arrays::{self, Block};
use crate::py::objects::{output_field, output_fields};

/// Whether the fast path's failures were said in the log (once per process each).
static WRITE_FAILED: AtomicBool = AtomicBool::new(false);
static DROP_FAILED: AtomicBool = AtomicBool::new(false);

/// Output kinds, as vLLM's `RequestOutputKind` numbers them (0 is `CUMULATIVE`).
const DELTA: u8 = 1;
pub(super) const FINAL_ONLY: u8 = 2;

/// Per-chunk stats context: vLLM's `IterationStats` and what this chunk adds to it.
pub(super) struct ChunkStats<'py> {
    pub(super) stats: Bound<'py, PyAny>,
    pub(super) latencies: Bound<'py, PyList>,
    pub(super) timestamp: f64,
    pub(super) nans: bool,
    pub(super) generated: i64,
}

/// One request's text, token ids, sample and prompt logprobs (see the module doc).
#[pyclass(module = "corewire._native", name = "RequestText")]
pub struct RequestText {
    pub(super) shared: Arc<Shared>,
    /// `None` when the request asked for no detokenization.
    pub(super) stream: Option<DecodeStream>,
    pub(super) text: OutputText,
    pub(super) token_ids: Py<PyList>,
    pub(super) num_logprobs: Option<i64>,
    pub(super) logprobs: Option<SampleLogprobs>,
    pub(super) cumulative: f64,
    /// The sampled ids of the last positions (the context of candidate corrections).
    pub(super) sampled: Vec<u32>,
    /// vLLM's `prompt_logprobs` parameter (None: the request asked for none).
    pub(super) num_prompt_logprobs: Option<i64>,
    /// The prompt logprobs not yet handed out, in vLLM's container (starting with the
    /// first prompt token's None), or None when the request asked for none.
    pub(super) prompt_logprobs: Option<SampleLogprobs>,
    /// The prompt token of each of the container's last positions (None for the first
    /// prompt token's), the context of the prompt candidates' corrections: vLLM reads
    /// it from the container, so it restarts when the container is handed out.
    pub(super) prompt_context: Vec<Option<u32>>,
    /// vLLM 0.34.0's fixed-id prompt scores (`prompt_token_id_logprobs`, an ndarray) not
    /// handed out yet.
    pub(super) prompt_token_id_logprobs: Option<Py<PyAny>>,
    /// The weight version this request's last span (vLLM's `weight_version_starts`)
    /// started with, as tracked on the fast path; None when unknown (vLLM's loop may
    /// have started one since: `update` forgets it).
    pub(super) weight_version: Option<String>,
    // What the request's outputs carry, fixed when it was added.
    pub(super) request_id: Py<PyString>,
    pub(super) external_req_id: Py<PyAny>,
    /// vLLM's `ParentRequest` of an n > 1 request's child (None otherwise): it chooses
    /// which outputs reach the collector and names the request.
    pub(super) parent: Option<Py<PyAny>>,
    pub(super) prompt: Py<PyAny>,
    pub(super) prompt_token_ids: Py<PyAny>,
    pub(super) lora_request: Py<PyAny>,
    pub(super) request_index: Py<PyAny>,
    pub(super) output_kind: u8,
    /// vLLM's stream interval: above 1, a `DELTA` request's outputs wait until this many
    /// tokens are new (its `RequestState.sent_tokens_offset` keeps the count sent).
    pub(super) stream_interval: i64,
    pub(super) queue: Py<PyAny>,
    /// Whether `queue` is exactly vLLM's `RequestOutputCollector` (its `put` is then
    /// done here for the common case, see `hand_off`).
    pub(super) plain_collector: bool,
    pub(super) stats: Option<Py<PyAny>>,
    /// Where the request's plain outputs go as SSE frames while it is on `vllm serve`'s
    /// fast path (`attach_stream`), instead of `RequestOutput`s to its collector.
    pub(super) sink: Option<StreamSink>,
    /// The output token ids the sink has carried (every attachment's).
    pub(super) streamed_tokens: usize,
    /// Where the next chunk's first token starts in the stream's text, as the completions
    /// API's logprobs count it (code points): the fast path's and Python's chunks share it.
    pub(super) stream_text_offset: usize,
}

impl RequestText {
    /// Writes the sink's waiting frames (their tokens counted as streamed). A sink that
    /// cannot go on is dropped, and the request's next outputs go to its collector again:
    /// the client reads slower than the stream comes, or is gone; a write that failed
    /// aborts the connection (the client must not read on with text missing), said once
    /// in the log. Never fails: a stream's trouble stays that stream's.
    pub(super) fn flush_stream(&mut self, py: Python<'_>) {
        let Some(sink) = self.sink.as_mut() else {
            return;
        };
        match sink.flush(py) {
            Ok(Flushed::Written(tokens, go_on)) => {
                self.streamed_tokens += tokens;
                if !go_on {
                    self.drop_quietly(py);
                }
            }
            Ok(Flushed::Gone) => self.drop_quietly(py),
            Err(e) => {
                sink.abort(py);
                self.drop_quietly(py);
                self.warn_once(py, &WRITE_FAILED, || {
                    format!(
                        "corewire: writing a stream to its connection failed ({e}); the \
                         connection was aborted (said once)"
                    )
                });
            }
        }
    }

    /// Whether the sink holds frames to write.
    pub(super) fn stream_pending(&self) -> bool {
        self.sink.as_ref().is_some_and(StreamSink::has_pending)
    }

    /// Hands the stream back to Python before an output that Python renders: the frames
    /// made so far go out first, so the connection sees every chunk in order. Never
    /// fails (see `flush_stream`).
    pub(super) fn release_stream(&mut self, py: Python<'_>) {
        if self.sink.is_some() {
            self.flush_stream(py);
            self.drop_quietly(py);
        }
    }

    /// `drop_stream`, its failure (vLLM's container refusing the kept positions) said once
    /// in the log instead of failing the batch.
    fn drop_quietly(&mut self, py: Python<'_>) {
        if let Err(e) = self.drop_stream(py) {
            self.warn_once(py, &DROP_FAILED, || {
                format!("corewire: a stream's kept logprobs were lost ({e}) (said once)")
            });
        }
    }

    fn warn_once(&self, py: Python<'_>, told: &AtomicBool, msg: impl FnOnce() -> String) {
        if !told.swap(true, Ordering::Relaxed) {
            // A logger that fails has nothing better to be told.
            let _ = self.shared.warn.bind(py).call1((msg(),));
        }
    }

    /// Takes the request off the fast path. Sampled positions kept for a frame that was
    /// not made yet (a stream interval's wait) go into vLLM's container, where the output
    /// that carries them will read them.
    fn drop_stream(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some(mut sink) = self.sink.take() else {
            return Ok(());
        };
        let kept = sink.take_positions();
        if kept.is_empty() {
            return Ok(());
        }
        let Some(store) = self.logprobs.as_ref() else {
            return Ok(());
        };
        for position in kept {
            let candidates = position.into_iter().map(|(id, logprob, rank, decoded)| {
                Ok(Candidate {
                    id,
                    logprob,
                    rank,
                    decoded: decoded.into_bound(py).into_any(),
                })
            });
            store.push(py, &self.shared, candidates)?;
        }
        Ok(())
    }

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
        let found = self.detokenize_text(py, ids, stop_terminated)?;
        let dropped = self.text.dropped();
        if dropped > 0 {
            // 0.33.0's rule: the ids after the one that completed the stop string go.
            let list = self.token_ids.bind(py);
            let len = list.len();
            list.del_slice(len - dropped, len)?;
        }
        Ok(found)
    }

    fn detokenize_text(
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
        let (Some(num), Some(store)) = (self.num_logprobs, self.logprobs.take()) else {
            return Err(PyRuntimeError::new_err(
                "logprobs for a request that asked for none",
            ));
        };
        // Out of `self` while the positions are added (the candidates read `self`), and
        // back on every return, an error's too.
        let added = self.add_positions(py, num, &store, lists, Positions::Sampled);
        self.logprobs = Some(store);
        added
    }

    /// Appends the positions of an output's `new_prompt_logprobs_tensors` (a
    /// `LogprobsTensors` of torch tensors or numpy arrays), as vLLM's
    /// `_update_prompt_logprobs` does.
    fn add_prompt_logprobs(&mut self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<()> {
        let (Some(num), Some(store)) = (self.num_prompt_logprobs, self.prompt_logprobs.take())
        else {
            return Err(PyRuntimeError::new_err(
                "prompt logprobs for a request that asked for none",
            ));
        };
        let arrays = (0..3)
            .map(|i| as_array(&arrays::item(tensors, i)?))
            .collect::<PyResult<Vec<_>>>();
        let added = match arrays {
            Ok(a) => {
                let lists = PyTuple::new(py, a)?;
                self.add_positions(py, num, &store, lists.as_any(), Positions::Prompt)
            }
            Err(e) => Err(e),
        };
        self.prompt_logprobs = Some(store);
        added
    }

    fn add_positions(
        &mut self,
        py: Python<'_>,
        num: i64,
        store: &SampleLogprobs,
        lists: &Bound<'_, PyAny>,
        kind: Positions,
    ) -> PyResult<()> {
        let ids: Block<i64> = arrays::block(&arrays::item(lists, 0)?)?;
        let lps: Block<f64> = arrays::block(&arrays::item(lists, 1)?)?;
        let ranks: Block<i64> = arrays::block(&arrays::item(lists, 2)?)?;
        let shared = Arc::clone(&self.shared);
        let positions = ids.rows.min(lps.rows).min(ranks.rows);
        for p in 0..positions {
            let (ids, lps, rank) = (ids.row(p), lps.row(p), ranks.row(p)[0]);
            let wanted = if num == -1 {
                lps.len()
            } else {
                num.max(0) as usize
            };
            let count = ids.len().min(lps.len()).min(1 + wanted);
            // The candidates' strings see the context of the positions before (on the
            // stack: at most MAX_CONTEXT ids).
            let mut context = [0u32; candidates::MAX_CONTEXT];
            let known: &mut dyn Iterator<Item = u32> = match kind {
                Positions::Sampled => &mut self.sampled.iter().copied(),
                Positions::Prompt => &mut self.prompt_context.iter().flatten().copied(),
            };
            let mut held = 0;
            for (slot, id) in context.iter_mut().zip(known) {
                *slot = id;
                held += 1;
            }
            let context = &context[..held];
            let keep = matches!(kind, Positions::Sampled)
                && self.sink.as_ref().is_some_and(StreamSink::wants_logprobs);
            let entries = (0..count).map(|i| {
                let decoded = if self.stream.is_some() {
                    self.candidate(py, &shared, ids[i], context)?.into_any()
                } else {
                    py.None().into_bound(py)
                };
                Ok(Candidate {
                    id: ids[i],
                    logprob: lps[i],
                    rank: if i == 0 { rank } else { i as i64 },
                    decoded,
                })
            });
            if keep {
                // The fast path's frame shows this position, and nothing else will: vLLM's
                // container is left without it (a DELTA output reads only its own last
                // positions; one the frame did not show goes back: `drop_stream`).
                let mut kept: PositionEntries = Vec::with_capacity(count);
                for i in 0..count {
                    let token = self.candidate(py, &shared, ids[i], context)?;
                    let rank = if i == 0 { rank } else { i as i64 };
                    kept.push((ids[i], lps[i], rank, token.unbind()));
                }
                if let Some(sink) = self.sink.as_mut() {
                    sink.keep_position(kept);
                }
            } else {
                store.push(py, &shared, entries)?;
            }
            let first = ids.first().map(|&id| u32::try_from(id).unwrap_or(u32::MAX));
            match kind {
                Positions::Sampled => {
                    if let Some(&value) = lps.first() {
                        self.cumulative += value;
                    }
                    if let Some(first) = first {
                        self.sampled.push(first);
                        if self.sampled.len() > candidates::MAX_CONTEXT {
                            self.sampled.remove(0);
                        }
                    }
                }
                Positions::Prompt => {
                    // A position of no candidates (zero-width rows) has no first id.
                    self.prompt_context.push(first.filter(|_| count > 0));
                    if self.prompt_context.len() > candidates::MAX_CONTEXT {
                        self.prompt_context.remove(0);
                    }
                }
            }
        }
        Ok(())
    }

    /// The prompt logprobs a `RequestOutput` carries: for `DELTA`, those not handed out
    /// yet, which are then forgotten (vLLM's `pop_prompt_logprobs`: a container with
    /// positions is replaced by an empty list, so later outputs carry that same list);
    /// for the other kinds the whole container. None when the request asked for none.
    fn prompt_logprobs_for_output<'py>(&mut self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        if self.output_kind == DELTA {
            self.take_prompt_logprobs(py)
        } else {
            self.prompt_logprobs.as_ref().map(|l| l.object(py))
        }
    }

    /// vLLM's `pop_prompt_logprobs`: the container, replaced by an empty list (and its
    /// correction context restarted) once it has positions.
    fn take_prompt_logprobs<'py>(&mut self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        let store = self.prompt_logprobs.as_ref()?;
        let object = store.object(py);
        if store.len(py) > 0 {
            self.prompt_logprobs = Some(SampleLogprobs::dicts(py));
            self.prompt_context.clear();
        }
        Some(object)
    }

    /// A candidate's string at the current position.
    fn candidate<'py>(
        &self,
        py: Python<'py>,
        shared: &Shared,
        id: i64,
        context: &[u32],
    ) -> PyResult<Bound<'py, PyString>> {
        let (s, incomplete) = shared.single(py, id)?;
        if !incomplete {
            return Ok(s);
        }
        let token = u32::try_from(id).map_err(|_| PyValueError::new_err("negative token id"))?;
        let fixed = candidates::correct(
            token,
            context,
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
    /// Puts the request on `vllm serve`'s fast path: its plain outputs from now on are
    /// written to `cycle` (uvicorn's request-response cycle of its streaming response,
    /// whose every earlier chunk has been written) as SSE frames (`head`, the text's
    /// literal, `mid`, the logprobs or `null`, `tail`), instead of going to its
    /// collector. `logprobs_limit`: with, and only with, sample logprobs, the candidates
    /// a chunk shows per position (-1: all); `text_offset`: where the next chunk's first
    /// token starts. Only a streamed (`DELTA`) request (`ValueError`: other outputs
    /// carry more); a request with prompt logprobs too (an echo with logprobs, or a
    /// streamed `prompt_logprobs: 0`), since an output carrying them is never plain, and
    /// goes to Python with the stream released first. One of n > 1 samples streams its own
    /// choice (a streamed parent passes its children's unfinished outputs on as they
    /// are, so frames can stand in for them). `skip_empty`: an output whose
    /// new text is empty gets no frame (with logprobs it is Python's to render);
    /// `release_ids`: an output with one of these token ids is Python's to render;
    /// `chat_logprobs`: the logprobs are a chat chunk's (`content`), not a completions
    /// chunk's; `ids_mid`, for a request whose chunks carry their token ids
    /// (`return_token_ids`): the bytes between the logprobs and the ids, which the frames
    /// then write; `usage`, for a request whose chunks carry their running usage
    /// (`continuous_usage_stats`): the bytes before the total and before the completion
    /// tokens, the prompt's tokens and the sample's output tokens so far, the frames then
    /// writing both counts after the logprobs or ids (`tail` follows the last hole).
    #[pyo3(signature = (
        cycle, head, mid, tail, logprobs_limit = None, text_offset = 0, skip_empty = false,
        release_ids = Vec::new(), chat_logprobs = false, ids_mid = None, usage = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn attach_stream(
        &mut self,
        py: Python<'_>,
        cycle: Py<PyAny>,
        head: Vec<u8>,
        mid: Vec<u8>,
        tail: Vec<u8>,
        logprobs_limit: Option<i64>,
        text_offset: usize,
        skip_empty: bool,
        release_ids: Vec<i64>,
        chat_logprobs: bool,
        ids_mid: Option<Vec<u8>>,
        usage: Option<(Vec<u8>, Vec<u8>, usize, usize)>,
    ) -> PyResult<()> {
        let refusal = if self.output_kind != DELTA {
            Some("its outputs are not deltas")
        } else if self.num_logprobs.is_some() != logprobs_limit.is_some() {
            Some("a logprobs limit goes with, and only with, a request for logprobs")
        } else if self.num_logprobs.is_some() && self.stream.is_none() {
            Some("its logprobs have no token strings (no detokenization)")
        } else {
            None
        };
        if let Some(why) = refusal {
            return Err(PyValueError::new_err(format!(
                "request {} cannot stream natively: {why}",
                self.request_id.bind(py)
            )));
        }
        // Attached again: the old sink's kept positions go back first.
        self.drop_quietly(py);
        // -1: every candidate (the API's `logprobs=-1`).
        let limit = logprobs_limit.map(|l| usize::try_from(l).ok());
        let mut template = FrameTemplate::new(head, mid, tail);
        if let Some(ids_mid) = ids_mid {
            template = template.with_ids(ids_mid);
        }
        let mut completion_tokens = 0;
        if let Some((before_total, before_completion, prompt_tokens, so_far)) = usage {
            template = template.with_usage(UsageHoles {
                before_total,
                before_completion,
                prompt_tokens,
            });
            completion_tokens = so_far;
        }
        self.sink = Some(StreamSink::new(
            py,
            cycle,
            template,
            limit,
            skip_empty,
            release_ids,
            chat_logprobs,
            completion_tokens,
        )?);
        self.stream_text_offset = text_offset;
        Ok(())
    }

    /// Where the next chunk's first token starts in the stream's text (completions
    /// logprobs' `text_offset`), shared by the fast path's chunks and Python's.
    #[getter]
    fn get_stream_text_offset(&self) -> usize {
        self.stream_text_offset
    }

    #[setter]
    fn set_stream_text_offset(&mut self, offset: usize) {
        self.stream_text_offset = offset;
    }

    /// Takes the request off the fast path; its outputs go to its collector again. What
    /// waits is written first with `flush` (an output of the request that Python will
    /// render comes next), dropped without (its response is over: finished, failed or
    /// cancelled).
    #[pyo3(signature = (flush = false))]
    fn detach_stream(&mut self, py: Python<'_>, flush: bool) {
        if flush {
            self.release_stream(py);
        } else {
            self.drop_quietly(py);
        }
    }

    /// Whether the request's plain outputs go to its connection (see `attach_stream`).
    #[getter]
    fn stream_attached(&self) -> bool {
        self.sink.is_some()
    }

    /// The output token ids carried by the fast path's frames, over the request's life.
    #[getter]
    fn streamed_tokens(&self) -> usize {
        self.streamed_tokens
    }

    /// Detokenizer: takes new token ids; returns the stop string that ended the text.
    fn update(
        &mut self,
        py: Python<'_>,
        new_token_ids: &Bound<'_, PyAny>,
        stop_terminated: bool,
    ) -> PyResult<Option<String>> {
        // vLLM's loop (the caller) may have started a weight-version span just before.
        self.weight_version = None;
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

    /// Logprobs processor: takes an output's sample logprobs, then its prompt logprobs.
    fn update_from_output(&mut self, py: Python<'_>, output: &Bound<'_, PyAny>) -> PyResult<()> {
        let names = Names::get(py);
        let lists = output.getattr(&names.new_logprobs)?;
        if !lists.is_none() {
            self.add_logprobs(py, &lists)?;
        }
        let tensors = output.getattr(&names.new_prompt_logprobs_tensors)?;
        if !tensors.is_none() {
            self.add_prompt_logprobs(py, &tensors)?;
        }
        // 0.34.0 on: the fixed-id prompt scores, kept as vLLM keeps them (a numpy view).
        if let Some(scores) = output.getattr_opt(&names.prompt_token_id_logprobs)? {
            if !scores.is_none() {
                self.prompt_token_id_logprobs = Some(scores.call_method0(&names.numpy)?.unbind());
            }
        }
        Ok(())
    }

    /// Logprobs processor (0.34.0 on): the fixed-id prompt scores not handed out yet.
    #[getter]
    fn prompt_token_id_logprobs(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.prompt_token_id_logprobs
            .as_ref()
            .map(|s| s.clone_ref(py))
    }

    /// Logprobs processor (0.34.0 on): the fixed-id prompt scores, forgotten.
    fn pop_prompt_token_id_logprobs(&mut self) -> Option<Py<PyAny>> {
        self.prompt_token_id_logprobs.take()
    }

    /// Logprobs processor: the sample logprobs so far (a list of dicts, or vLLM's
    /// `FlatLogprobs`), or None.
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.logprobs.as_ref().map(|l| l.object(py))
    }

    /// Logprobs processor: the sum of the sampled tokens' logprobs, or None.
    #[getter]
    fn cumulative_logprob<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.cumulative_value(py)
    }

    /// Logprobs processor: the prompt logprobs not handed out yet (vLLM's container),
    /// or None when the request asked for none.
    #[getter]
    fn prompt_logprobs<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.prompt_logprobs.as_ref().map(|l| l.object(py))
    }

    /// Logprobs processor: the prompt logprobs not handed out yet, forgotten once they
    /// have positions (vLLM's `pop_prompt_logprobs`); None when the request asked for
    /// none.
    fn pop_prompt_logprobs<'py>(&mut self, py: Python<'py>) -> Option<Bound<'py, PyAny>> {
        self.take_prompt_logprobs(py)
    }
}

impl RequestText {
    /// vLLM's per-output work for a plain output (see `plain`); true when a stop string
    /// finished the request.
    pub(super) fn fast_output<'py>(
        &mut self,
        py: Python<'py>,
        output: &Bound<'py, PyAny>,
        req_state: &Bound<'py, PyAny>,
        chunk: Option<&mut ChunkStats<'py>>,
        weight_version: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<bool> {
        let names = Names::get(py);
        let fields = output_fields(output);
        let field = |field, name| output_field(output, fields.as_ref(), field, name);
        let new_ids = field(OutputField::NewTokenIds, &names.new_token_ids)?;
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
                && field(OutputField::NumNansInLogits, &names.num_nans_in_logits)?
                    .extract::<i64>()?
                    > 0
            {
                stats.setattr(&names.is_corrupted, true)?;
            }
            let last = stats.getattr(&names.last_token_ts)?.extract::<f64>()?;
            c.latencies.append(c.timestamp - last)?;
            stats.setattr(&names.last_token_ts, c.timestamp)?;
        }
        // (0.33.0 on) The weight version's span, as `track_weight_version` starts one.
        if let Some(version) = weight_version {
            if !version.is_none() && new_ids.len()? > 0 {
                // The same version as the last span's: nothing to start (the common case,
                // checked without reading vLLM's list).
                let text = version
                    .cast::<PyString>()
                    .ok()
                    .and_then(|s| s.to_str().ok());
                if text.is_none() || self.weight_version.as_deref() != text {
                    self.track_weight_version(py, req_state, version)?;
                    self.weight_version = text.map(str::to_owned);
                }
            }
        }
        // 2) Detokenize and check stop strings; 3) sample logprobs.
        let ids = self.take_ids(py, &new_ids)?;
        let stop = self.detokenize(py, &ids, false)?;
        let mut lists = field(OutputField::NewLogprobs, &names.new_logprobs)?;
        let dropped = self.text.dropped();
        if dropped > 0 {
            // vLLM's `_trim_surplus_tokens`: the output keeps only the ids up to the stop.
            let kept = ids.len() - dropped;
            new_ids.cast::<PyList>()?.del_slice(kept, ids.len())?;
            if !lists.is_none() {
                lists = lists.call_method1(&names.slice_request, (0, kept))?;
            }
        }
        if !lists.is_none() {
            self.add_logprobs(py, &lists)?;
        }
        // 4) The RequestOutput, to the request's collector (or, on the fast path, the
        //    output's frame to its sink).
        let finished = stop.is_some();
        if finished || self.output_kind != FINAL_ONLY {
            if let Some(token_ids) = self.interval_ids(py, req_state, new_ids, finished)? {
                if let (Some(sink), false) = (self.sink.as_mut(), finished) {
                    let ids: Vec<i64> = if sink.wants_ids() {
                        token_ids.extract()?
                    } else {
                        Vec::new()
                    };
                    let empty_released = sink.releases_empty() && !self.text.has_next_output(false);
                    if !empty_released && sink.can_render(py, &ids) {
                        let tokens = token_ids.len()?;
                        let text = self.text.next_output(false, true);
                        match sink.push(py, text, &ids, tokens, &mut self.stream_text_offset) {
                            Ok(()) => return Ok(false),
                            // The text went to a frame that is not: the connection must
                            // not go on without it.
                            Err(_) => {
                                sink.abort(py);
                                self.drop_quietly(py);
                                return Ok(false);
                            }
                        }
                    }
                }
                // A finish (or an output the sink cannot show) is Python's to render.
                self.release_stream(py);
                if let Some(out) = self.request_output(py, req_state, &token_ids, stop)? {
                    self.hand_off(py, out)?;
                }
            }
        }
        Ok(finished)
    }

    /// vLLM's `RequestState.track_weight_version`: a new span (version, output tokens so
    /// far) when the version differs from the last span's.
    fn track_weight_version<'py>(
        &self,
        py: Python<'py>,
        req_state: &Bound<'py, PyAny>,
        version: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let names = Names::get(py);
        let starts = req_state
            .getattr(&names.weight_version_starts)?
            .cast_into::<PyList>()?;
        let n = starts.len();
        if n == 0 || starts.get_item(n - 1)?.get_item(0)?.ne(version)? {
            starts.append((version, self.text.tokens()))?;
        }
        Ok(())
    }

    /// vLLM's `RequestState._weight_version_spans` (which asks the detokenizer, this
    /// object, for the token count: not callable from here): the spans from the tracked
    /// starts to the output's token count, or None when no version was reported for the
    /// tokens there are.
    fn weight_version_spans<'py>(
        &self,
        py: Python<'py>,
        req_state: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let names = Names::get(py);
        let starts = req_state
            .getattr(&names.weight_version_starts)?
            .cast_into::<PyList>()?;
        let tokens = self.text.tokens();
        if starts.is_empty() && tokens > 0 {
            return Ok(py.None().into_bound(py));
        }
        let span = py.import("vllm.outputs")?.getattr("WeightVersionSpan")?;
        let spans = PyList::empty(py);
        for i in 0..starts.len() {
            let start = starts.get_item(i)?;
            let end = if i + 1 < starts.len() {
                starts.get_item(i + 1)?.get_item(1)?
            } else {
                tokens.into_bound_py_any(py)?
            };
            spans.append(span.call1((start.get_item(0)?, start.get_item(1)?, end))?)?;
        }
        Ok(spans.into_any())
    }

    /// The token ids of this output's `RequestOutput` under the stream interval, as
    /// vLLM's `make_request_output` chooses them, or None when the output waits: above
    /// 1, only a finish, a request's first sent output or `stream_interval` new tokens
    /// are sent, and a `DELTA` output then carries every id since the last one sent.
    /// (Other kinds never move `sent_tokens_offset` from 0, so every output is sent: as
    /// in vLLM.)
    fn interval_ids<'py>(
        &self,
        py: Python<'py>,
        req_state: &Bound<'py, PyAny>,
        new_ids: Bound<'py, PyAny>,
        finished: bool,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        if self.stream_interval <= 1 {
            return Ok(Some(new_ids));
        }
        let names = Names::get(py);
        let offset: i64 = req_state.getattr(&names.sent_tokens_offset)?.extract()?;
        let total = self.text.tokens() as i64;
        if !(finished || offset == 0 || total - offset >= self.stream_interval) {
            return Ok(None);
        }
        if self.output_kind != DELTA {
            return Ok(Some(new_ids));
        }
        let all = self.token_ids.bind(py);
        // Python's all[offset:] (an offset is never negative: vLLM only stores counts).
        let start = usize::try_from(offset).unwrap_or(0).min(all.len());
        let ids = all.get_slice(start, all.len()).into_any();
        req_state.setattr(&names.sent_tokens_offset, total)?;
        Ok(Some(ids))
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

    /// The `RequestOutput` of a plain output, as vLLM's `RequestState` makes it, or
    /// None when an n > 1 request's parent holds it back.
    fn request_output<'py>(
        &mut self,
        py: Python<'py>,
        req_state: &Bound<'py, PyAny>,
        new_ids: &Bound<'py, PyAny>,
        stop: Option<usize>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
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
            // 0.33.0 on: an output without new ids carries no positions (`[:0]`).
            Some(all) if delta && self.shared.empty_delta_slice && token_ids.len()? == 0 => {
                all.object(py).get_item(PySlice::new(py, 0, 0, 1))?
            }
            // vLLM slices a non-empty container to the output's new positions.
            Some(all) if delta && all.len(py) > 0 => {
                all.tail(py, &self.shared, token_ids.len()?)?
            }
            Some(all) => all.object(py),
        };
        let (reason, stop_reason) = match stop {
            Some(i) => (
                Some(PyString::new(py, "stop").into_any()),
                Some(PyString::new(py, self.text.stop(i)).into_any()),
            ),
            None => (None, None),
        };
        let shared = Arc::clone(&self.shared);
        let layout = &shared.completion_layout;
        // Indexed as COMPLETION_FIELDS.
        let mut values: [Option<Bound<'py, PyAny>>; COMPLETION_FIELDS.len()] =
            std::array::from_fn(|_| None);
        values[0] = Some(self.request_index.bind(py).clone());
        values[1] = Some(text);
        values[2] = Some(token_ids);
        values[3] = Some(self.cumulative_value(py));
        values[4] = Some(logprobs);
        values[6] = reason;
        values[7] = stop_reason;
        if finished {
            // 0.33.0 on: what a finished output carries of the request's state.
            if layout.has(10) {
                values[10] = Some(req_state.getattr(&n.spec_decode_metrics)?);
            }
            if layout.has(11) {
                values[11] = Some(self.weight_version_spans(py, req_state)?);
            }
        }
        let completion = shared.instance_in(py, &shared.completion_output, layout, &mut values)?;
        let (request_id, outputs, finished) = match &self.parent {
            None => (
                self.external_req_id.bind(py).clone(),
                PyList::new(py, [completion])?.into_any(),
                finished,
            ),
            Some(parent) => {
                // vLLM's `ParentRequest.get_outputs`: this child's output alone while
                // streaming, all of them once every child finished for FINAL_ONLY.
                let parent = parent.bind(py);
                let (outputs, finished): (Bound<'py, PyAny>, bool) = parent
                    .call_method1(&n.get_outputs, (self.request_id.bind(py), completion))?
                    .extract()?;
                if !outputs.is_truthy()? {
                    return Ok(None);
                }
                (parent.getattr(&n.external_req_id)?, outputs, finished)
            }
        };
        let layout = &shared.request_output_layout;
        let mut values: [Option<Bound<'py, PyAny>>; REQUEST_OUTPUT_FIELDS.len()] =
            std::array::from_fn(|_| None);
        values[0] = Some(request_id);
        values[1] = Some(self.prompt.bind(py).clone());
        values[2] = Some(self.prompt_token_ids.bind(py).clone());
        // Only an output that goes out hands the prompt logprobs out (vLLM pops them in
        // `_new_request_output`).
        values[3] = self.prompt_logprobs_for_output(py);
        if layout.has(4) {
            values[4] = if delta {
                self.prompt_token_id_logprobs.take()
            } else {
                self.prompt_token_id_logprobs
                    .as_ref()
                    .map(|s| s.clone_ref(py))
            }
            .map(|s| s.into_bound(py));
        }
        values[5] = Some(outputs);
        values[6] = Some(finished.into_bound_py_any(py)?);
        values[7] = self.stats.as_ref().map(|s| s.bind(py).clone());
        values[8] = Some(self.lora_request.bind(py).clone());
        values[11] = Some(req_state.getattr(&n.num_cached_tokens)?);
        if layout.has(12) {
            values[12] = Some(req_state.getattr(&n.num_cache_creation_tokens)?);
        }
        shared
            .instance_in(py, &shared.request_output, layout, &mut values)
            .map(Some)
    }
}

/// Which of a request's logprobs a block of positions is for.
#[derive(Clone, Copy)]
enum Positions {
    /// Sampled tokens' (`new_logprobs`): they add to the cumulative logprob and are
    /// the context of later sample candidates.
    Sampled,
    /// Prompt tokens' (`new_prompt_logprobs_tensors`).
    Prompt,
}

/// A tensor as something [`arrays::block`] reads quickly: a torch tensor's numpy view
/// (`Tensor.numpy()` shares the memory of a CPU tensor), or its `tolist()` where there
/// is no such view (another device); anything else (a numpy array) as it is.
fn as_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let names = Names::get(obj.py());
    if !obj.hasattr(&names.numpy)? {
        return Ok(obj.clone());
    }
    obj.call_method0(&names.numpy)
        .or_else(|_| obj.call_method0(&names.tolist))
}
