//! Interned attribute names of vLLM's objects.

use pyo3::prelude::*;
use pyo3::types::PyString;

/// Interned attribute names.
pub(super) struct Names {
    pub(super) request_id: Py<PyString>,
    pub(super) new_token_ids: Py<PyString>,
    pub(super) finish_reason: Py<PyString>,
    pub(super) events: Py<PyString>,
    pub(super) pooling_output: Py<PyString>,
    pub(super) kv_transfer_params: Py<PyString>,
    pub(super) routed_experts: Py<PyString>,
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
    // FlatLogprobs' lists (with `token_ids` and `logprobs` below).
    pub(super) start_indices: Py<PyString>,
    pub(super) end_indices: Py<PyString>,
    pub(super) ranks: Py<PyString>,
    pub(super) decoded_tokens: Py<PyString>,
    // CompletionOutput's fields, in order.
    pub(super) index: Py<PyString>,
    pub(super) text: Py<PyString>,
    pub(super) token_ids: Py<PyString>,
    pub(super) cumulative_logprob: Py<PyString>,
    pub(super) logprobs: Py<PyString>,
    pub(super) stop_reason: Py<PyString>,
    pub(super) lora_request: Py<PyString>,
    // RequestOutput's fields, in order (those not above).
    pub(super) prompt: Py<PyString>,
    pub(super) prompt_token_ids: Py<PyString>,
    pub(super) prompt_logprobs: Py<PyString>,
    pub(super) outputs: Py<PyString>,
    pub(super) finished: Py<PyString>,
    pub(super) metrics: Py<PyString>,
    pub(super) encoder_prompt: Py<PyString>,
    pub(super) encoder_prompt_token_ids: Py<PyString>,
    // Tensor methods (prompt logprobs).
    pub(super) numpy: Py<PyString>,
    pub(super) tolist: Py<PyString>,
    // ParentRequest (n > 1).
    pub(super) get_outputs: Py<PyString>,
    pub(super) external_req_id: Py<PyString>,
}

static NAMES: pyo3::sync::PyOnceLock<Names> = pyo3::sync::PyOnceLock::new();

impl Names {
    pub(super) fn get(py: Python<'_>) -> &'static Names {
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
                sent_tokens_offset: n("sent_tokens_offset"),
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
                numpy: n("numpy"),
                tolist: n("tolist"),
                get_outputs: n("get_outputs"),
                external_req_id: n("external_req_id"),
            }
        })
    }
}
