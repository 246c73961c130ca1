//! `OutputCore` and `RequestText`: the native side of `corewire.vllm.output.processor`.
//!
//! `RequestText` is one request's detokenizer and sample-logprobs state. It answers the
//! calls vLLM's `RequestState` makes on its `detokenizer` and `logprobs_processor` (the
//! same object stands in for both), so vLLM's own loop can drive it for the outputs that
//! need vLLM's bookkeeping (a request's first output, engine finishes, events).
//! `OutputCore.process` takes every other output of such requests from a chunk and does
//! vLLM 0.25.1's per-output work for them without Python: stats, detokenization, stop
//! strings, logprobs, the `RequestOutput` and its hand-off to the request's collector.
//!
//! Modules: `shared` (the tokenizer, vLLM's classes and the candidate cache every request
//! of a processor shares), `names` (interned attribute names), `request` (`RequestText`
//! and the per-output work), `samples` (the sample logprobs container: position dicts or
//! vLLM's `FlatLogprobs`), `sink` (the SSE frames of a request on `vllm serve`'s fast path,
//! written to its connection), `core` (`OutputCore`: the chunk loop).

mod core;
mod names;
mod request;
mod samples;
mod shared;
mod sink;

pub use self::core::OutputCore;
pub use request::RequestText;

/// The `tokenizers` crate release this module decodes with (major.minor; keep in step
/// with Cargo.toml). The Python side compares it with the `tokenizers` package vLLM
/// decodes with, and keeps vLLM's path when they differ.
pub const TOKENIZERS_VERSION: &str = "0.23";
