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

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::core::sse::{http_chunk, FrameTemplate};

use super::names::Names;

/// One stream's frames not yet written, and its connection.
pub(super) struct StreamSink {
    template: FrameTemplate,
    /// uvicorn's request-response cycle of the connection: its `disconnected` and
    /// `flow.write_paused` say whether writing on is right.
    cycle: Py<PyAny>,
    /// The cycle's asyncio transport (its `write`).
    transport: Py<PyAny>,
    pending: Vec<u8>,
}

impl StreamSink {
    /// A sink writing to `cycle`'s transport, with the stream's frame template.
    pub(super) fn new(
        py: Python<'_>,
        cycle: Py<PyAny>,
        head: Vec<u8>,
        tail: Vec<u8>,
    ) -> PyResult<Self> {
        let transport = cycle.bind(py).getattr(&Names::get(py).transport)?.unbind();
        Ok(StreamSink {
            template: FrameTemplate::new(head, tail),
            cycle,
            transport,
            pending: Vec::new(),
        })
    }

    /// Adds the frame of an output whose new text is `text`.
    pub(super) fn push(&mut self, text: &str) {
        self.template.render(&mut self.pending, text);
    }

    /// Whether frames wait to be written.
    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Writes the waiting frames as one HTTP chunk. False when the stream must go back to
    /// Python: the client is gone (nothing written), or it reads slower than the stream
    /// comes (the transport paused writing: vLLM's path waits for it to drain).
    pub(super) fn flush(&mut self, py: Python<'_>) -> PyResult<bool> {
        if self.pending.is_empty() {
            return Ok(true);
        }
        let body = std::mem::take(&mut self.pending);
        let names = Names::get(py);
        let cycle = self.cycle.bind(py);
        if cycle.getattr(&names.disconnected)?.is_truthy()? {
            return Ok(false);
        }
        let chunk = PyBytes::new(py, &http_chunk(&body));
        self.transport
            .bind(py)
            .call_method1(&names.write, (chunk,))?;
        let paused = cycle
            .getattr(&names.flow)?
            .getattr(&names.write_paused)?
            .is_truthy()?;
        Ok(!paused)
    }
}
