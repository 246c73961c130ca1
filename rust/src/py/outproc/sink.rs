//! `StreamSink`: where the SSE frames of a request on the fast path go, straight to its
//! HTTP connection.
//!
//! vLLM's OpenAI server renders each chunk of a streaming completion in Python and hands it
//! to uvicorn through Starlette. For a request the Python side has checked (see
//! `corewire.vllm.fast_path`), the plain chunks between its first and its last are rendered
//! here from the request's native state, gathered per processed batch, and written as one
//! HTTP chunk per stream to uvicorn's transport, the same bytes uvicorn itself writes for a
//! chunk. Python keeps the response's start, its first and last chunks, and every output
//! that needs Python (the sink is released first, so that the connection sees the chunks
//! in order).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::core::sse::{
    http_chunk, push_chat_logprobs, push_completion_logprobs, Candidate, FrameTemplate,
    FrameValues, Position,
};

use super::names::Names;

/// One sampled position's candidates in the engine's order: id, logprob, rank, string.
pub(super) type PositionEntries = Vec<(i64, f64, i64, Py<PyString>)>;

/// One stream's frames not yet written, and its connection.
pub(super) struct StreamSink {
    template: FrameTemplate,
    /// For a request with logprobs: how many of a position's candidates a chunk shows
    /// (None: all), as the completions API limits them.
    logprobs_limit: Option<Option<usize>>,
    /// The sampled positions not yet in a frame (a request with logprobs).
    positions: Vec<PositionEntries>,
    /// uvicorn's request-response cycle of the connection: its `disconnected` and
    /// `flow.write_paused` say whether writing on is right.
    cycle: Py<PyAny>,
    /// The cycle's asyncio transport (its `write`).
    transport: Py<PyAny>,
    pending: Vec<u8>,
    /// The output token ids the waiting frames carry (and the outputs skipped).
    pending_tokens: usize,
    /// Whether an output whose new text is empty gets no frame (its tokens still count):
    /// the chunks of a server with a tool-call parser, for a request that calls no tools,
    /// where vLLM's parser sends nothing for such an output.
    skip_empty: bool,
    /// Token ids that hand the output carrying one to Python (a reasoning parser's start
    /// and end markers: its delta changes kind there).
    release_ids: Vec<i64>,
    /// Whether the logprobs are a chat chunk's (else a completions chunk's).
    chat_logprobs: bool,
    /// The sample's output tokens so far, this sink's frames' included (a frame's running
    /// usage shows it, where the template has its holes).
    completion_tokens: usize,
}

/// What writing a sink's waiting frames came to.
pub(super) enum Flushed {
    /// Written (this many output token ids); the bool: whether the stream may go on
    /// natively (false: the transport paused writing, the client reads slower than the
    /// stream comes, and vLLM's path waits for it to drain).
    Written(usize, bool),
    /// The connection is gone or its response over: nothing was written.
    Gone,
}

impl StreamSink {
    /// A sink writing to `cycle`'s transport, with the stream's frame template; for a
    /// request with logprobs, `logprobs_limit` is `Some(limit)`; `skip_empty`,
    /// `release_ids`, `chat_logprobs` and `completion_tokens` (so far): see the fields.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        py: Python<'_>,
        cycle: Py<PyAny>,
        template: FrameTemplate,
        logprobs_limit: Option<Option<usize>>,
        skip_empty: bool,
        release_ids: Vec<i64>,
        chat_logprobs: bool,
        completion_tokens: usize,
    ) -> PyResult<Self> {
        let transport = cycle.bind(py).getattr(&Names::get(py).transport)?.unbind();
        Ok(StreamSink {
            template,
            logprobs_limit,
            positions: Vec::new(),
            cycle,
            transport,
            pending: Vec::new(),
            pending_tokens: 0,
            skip_empty,
            release_ids,
            chat_logprobs,
            completion_tokens,
        })
    }

    /// Whether the stream's chunks carry logprobs (its positions are to be kept).
    pub(super) fn wants_logprobs(&self) -> bool {
        self.logprobs_limit.is_some()
    }

    /// Whether an output without new text is Python's to render: with logprobs or token
    /// ids, where such outputs get no frame of their own (`skip_empty`), vLLM's chunk for
    /// one still carries them under an empty delta, which the template cannot write.
    pub(super) fn releases_empty(&self) -> bool {
        self.skip_empty && (self.logprobs_limit.is_some() || self.template.has_ids())
    }

    /// Whether `can_render` and `push` need an output's new token ids.
    pub(super) fn wants_ids(&self) -> bool {
        self.logprobs_limit.is_some() || !self.release_ids.is_empty() || self.template.has_ids()
    }

    /// Keeps a sampled position for the next frame.
    pub(super) fn keep_position(&mut self, entries: PositionEntries) {
        self.positions.push(entries);
    }

    /// The kept positions, taken (the sink is going: see `RequestText::drop_stream`).
    pub(super) fn take_positions(&mut self) -> Vec<PositionEntries> {
        std::mem::take(&mut self.positions)
    }

    /// Whether the frame of an output with new token ids `ids` can be made: never when one
    /// of them is a release id; else without logprobs always; with them, when a kept
    /// position stands for each id, holding that id, its strings readable (else the output
    /// is Python's to render, the positions going back to vLLM's container: see
    /// `RequestText::drop_stream`).
    pub(super) fn can_render(&self, py: Python<'_>, ids: &[i64]) -> bool {
        if ids.iter().any(|id| self.release_ids.contains(id)) {
            return false;
        }
        if self.logprobs_limit.is_none() {
            return true;
        }
        ids.len() == self.positions.len()
            && ids.iter().zip(&self.positions).all(|(&id, entries)| {
                entries.iter().any(|e| e.0 == id)
                    && entries.iter().all(|e| e.3.bind(py).to_str().is_ok())
            })
    }

    /// Adds the frame of an output whose new text is `text` and new token ids `ids`
    /// (`tokens` of them; the logprobs of the kept positions, one per id, `text_offset`
    /// as the completions API counts it, moved past them; the ids themselves where the
    /// template has their hole). Call after `can_render`.
    pub(super) fn push(
        &mut self,
        py: Python<'_>,
        text: &str,
        ids: &[i64],
        tokens: usize,
        text_offset: &mut usize,
    ) -> PyResult<()> {
        self.pending_tokens += tokens;
        self.completion_tokens += tokens;
        let Some(limit) = self.logprobs_limit else {
            if !(self.skip_empty && text.is_empty()) {
                let values = FrameValues {
                    text,
                    logprobs: None,
                    ids,
                    completion_tokens: self.completion_tokens,
                };
                self.template.render(&mut self.pending, &values);
            }
            return Ok(());
        };
        let kept = std::mem::take(&mut self.positions);
        let mut positions = Vec::with_capacity(kept.len());
        for (&id, entries) in ids.iter().zip(&kept) {
            // The position's dict: a repeated id keeps its first place, takes the value.
            let mut dict: Vec<(i64, Candidate<'_>)> = Vec::with_capacity(entries.len());
            for (entry_id, logprob, _, token) in entries {
                let candidate = Candidate {
                    token: token.bind(py).to_str()?,
                    logprob: *logprob,
                };
                match dict.iter_mut().find(|(i, _)| i == entry_id) {
                    Some(slot) => slot.1 = candidate,
                    None => dict.push((*entry_id, candidate)),
                }
            }
            // The sampled id's own entry, as the API reads `position[token_id]`
            // (`can_render` saw it there).
            let sampled = dict
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, c)| c.clone())
                .ok_or_else(|| PyValueError::new_err("a sampled id without its position"))?;
            let shown = limit.unwrap_or(dict.len()).min(dict.len());
            positions.push(Position {
                sampled,
                top: dict.into_iter().take(shown).map(|(_, c)| c).collect(),
            });
        }
        let mut logprobs = Vec::with_capacity(64 * positions.len().max(1));
        if self.chat_logprobs {
            push_chat_logprobs(&mut logprobs, &positions);
        } else {
            push_completion_logprobs(&mut logprobs, &positions, text_offset);
        }
        let values = FrameValues {
            text,
            logprobs: Some(&logprobs),
            ids,
            completion_tokens: self.completion_tokens,
        };
        self.template.render(&mut self.pending, &values);
        Ok(())
    }

    /// Whether frames (or the tokens of skipped outputs) wait to be written.
    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty() || self.pending_tokens > 0
    }

    /// Writes the waiting frames as one HTTP chunk, unless the connection is gone or its
    /// response over (uvicorn's `disconnected`, `response_complete`, or a closing
    /// transport: a late write would land in the connection's next response).
    pub(super) fn flush(&mut self, py: Python<'_>) -> PyResult<Flushed> {
        if self.pending.is_empty() {
            // Only skipped outputs: nothing to write, their tokens are the stream's.
            return Ok(Flushed::Written(
                std::mem::take(&mut self.pending_tokens),
                true,
            ));
        }
        let body = std::mem::take(&mut self.pending);
        let tokens = std::mem::take(&mut self.pending_tokens);
        let names = Names::get(py);
        let cycle = self.cycle.bind(py);
        let transport = self.transport.bind(py);
        if cycle.getattr(&names.disconnected)?.is_truthy()?
            || cycle.getattr(&names.response_complete)?.is_truthy()?
            || transport.call_method0(&names.is_closing)?.is_truthy()?
        {
            return Ok(Flushed::Gone);
        }
        let chunk = PyBytes::new(py, &http_chunk(&body));
        transport.call_method1(&names.write, (chunk,))?;
        let paused = cycle
            .getattr(&names.flow)?
            .getattr(&names.write_paused)?
            .is_truthy()?;
        Ok(Flushed::Written(tokens, !paused))
    }

    /// Aborts the connection (a write failed: the client must not read on as if nothing
    /// were missing).
    pub(super) fn abort(&self, py: Python<'_>) {
        // Nothing more to do if even that fails: the connection is broken already.
        let _ = self.transport.bind(py).call_method0(&Names::get(py).abort);
    }
}
