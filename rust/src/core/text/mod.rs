//! The text side of output processing, as vLLM's front-end does it per request: incremental
//! detokenization ([`stream`] over [`decoder`]), the output text with its stop strings and hold-back
//! ([`output`], [`stops`]), and the token strings of logprob candidates ([`candidates`]).
//!
//! Python strings count code points, not bytes; [`chars`] holds the conversions so that
//! every length and offset here means what the same number means in vLLM's Python.

pub mod candidates;
pub mod chars;
pub mod decoder;
pub mod output;
pub mod stops;
pub mod stream;

#[cfg(test)]
mod tests;
