//! Interned attribute names of vLLM's objects.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// Interned attribute names.
pub(super) struct Names {
    pub(super) request_id: Py<PyString>,
    pub(super) new_token_ids: Py<PyString>,
    pub(super) new_logprobs: Py<PyString>,
    pub(super) new_prompt_logprobs_tensors: Py<PyString>,
    pub(super) num_nans_in_logits: Py<PyString>,
    pub(super) detokenizer: Py<PyString>,
    pub(super) is_prefilling: Py<PyString>,
    pub(super) num_cached_tokens: Py<PyString>,
    pub(super) sent_tokens_offset: Py<PyString>,
    pub(super) num_generation_tokens: Py<PyString>,
    pub(super) last_token_ts: Py<PyString>,
    pub(super) is_corrupted: Py<PyString>,
    pub(super) inter_token_latencies_iter: Py<PyString>,
    pub(super) put: Py<PyString>,
    pub(super) output: Py<PyString>,
    pub(super) ready: Py<PyString>,
    pub(super) set: Py<PyString>,
    pub(super) logprob: Py<PyString>,
    pub(super) rank: Py<PyString>,
    pub(super) decoded_token: Py<PyString>,
    // FlatLogprobs' lists.
    pub(super) token_ids: Py<PyString>,
    pub(super) logprobs: Py<PyString>,
    pub(super) start_indices: Py<PyString>,
    pub(super) end_indices: Py<PyString>,
    pub(super) ranks: Py<PyString>,
    pub(super) decoded_tokens: Py<PyString>,
    // Tensor methods (prompt logprobs).
    pub(super) numpy: Py<PyString>,
    pub(super) tolist: Py<PyString>,
    // ParentRequest (n > 1).
    pub(super) get_outputs: Py<PyString>,
    pub(super) external_req_id: Py<PyString>,
    // vLLM 0.33.0 and later.
    pub(super) slice_request: Py<PyString>,
    pub(super) weight_version_starts: Py<PyString>,
    pub(super) spec_decode_metrics: Py<PyString>,
    pub(super) num_cache_creation_tokens: Py<PyString>,
    pub(super) prompt_token_id_logprobs: Py<PyString>,
    pub(super) sampling_mask_chunks: Py<PyString>,
    // uvicorn's request-response cycle (the fast path's sink).
    pub(super) transport: Py<PyString>,
    pub(super) write: Py<PyString>,
    pub(super) disconnected: Py<PyString>,
    pub(super) flow: Py<PyString>,
    pub(super) write_paused: Py<PyString>,
    pub(super) response_complete: Py<PyString>,
    pub(super) is_closing: Py<PyString>,
    pub(super) abort: Py<PyString>,
}

static NAMES: pyo3::sync::PyOnceLock<Names> = pyo3::sync::PyOnceLock::new();

impl Names {
    pub(super) fn get(py: Python<'_>) -> &'static Names {
        NAMES.get_or_init(py, || {
            let n = |s: &str| PyString::intern(py, s).unbind();
            Names {
                request_id: n("request_id"),
                new_token_ids: n("new_token_ids"),
                new_logprobs: n("new_logprobs"),
                new_prompt_logprobs_tensors: n("new_prompt_logprobs_tensors"),
                num_nans_in_logits: n("num_nans_in_logits"),
                detokenizer: n("detokenizer"),
                is_prefilling: n("is_prefilling"),
                num_cached_tokens: n("num_cached_tokens"),
                sent_tokens_offset: n("sent_tokens_offset"),
                token_ids: n("token_ids"),
                logprobs: n("logprobs"),
                start_indices: n("start_indices"),
                end_indices: n("end_indices"),
                ranks: n("ranks"),
                decoded_tokens: n("decoded_tokens"),
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
                numpy: n("numpy"),
                tolist: n("tolist"),
                get_outputs: n("get_outputs"),
                external_req_id: n("external_req_id"),
                slice_request: n("slice_request"),
                weight_version_starts: n("weight_version_starts"),
                spec_decode_metrics: n("spec_decode_metrics"),
                num_cache_creation_tokens: n("num_cache_creation_tokens"),
                prompt_token_id_logprobs: n("prompt_token_id_logprobs"),
                sampling_mask_chunks: n("sampling_mask_chunks"),
                transport: n("transport"),
                write: n("write"),
                disconnected: n("disconnected"),
                flow: n("flow"),
                write_paused: n("write_paused"),
                response_complete: n("response_complete"),
                is_closing: n("is_closing"),
                abort: n("abort"),
            }
        })
    }
}
