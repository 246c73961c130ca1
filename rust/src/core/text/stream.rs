//! Incremental detokenization of one request over the `tokenizers` crate, the same steps
//! the `tokenizers` Python package's `DecodeStream` takes (vLLM's fast detokenizer drives
//! that from Python, one call per token).

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::Tokenizer;

/// The message the crate's stream error starts with when a decode no longer extends the
/// text already produced (vLLM restarts the stream without the prompt then).
pub const INVALID_PREFIX: &str = "Invalid prefix encountered";

/// What a step can report besides its text.
#[derive(Debug, PartialEq, Eq)]
pub enum StepNote {
    /// The id does not fit a token id: no text.
    InvalidId(i64),
    /// The stream restarted without its prompt after an invalid prefix.
    Restarted,
}

/// A decode error of the crate, as text.
#[derive(Debug)]
pub struct DecodeError(pub String);

/// One request's stream state.
#[derive(Debug)]
pub struct DecodeStream {
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    skip_special_tokens: bool,
    /// Added tokens by id, set when special tokens are written without spaces between.
    added: Option<Arc<HashMap<u32, String>>>,
    last_special: bool,
}

impl DecodeStream {
    /// A stream that continues after `prompt`. `added` (the tokenizer's added tokens)
    /// is used only when spaces between special tokens are not wanted.
    pub fn new(
        prompt: &[u32],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        added: &Arc<HashMap<u32, String>>,
    ) -> Self {
        let spaces = skip_special_tokens || spaces_between_special_tokens || added.is_empty();
        DecodeStream {
            ids: prompt.to_vec(),
            prefix: String::new(),
            prefix_index: 0,
            skip_special_tokens,
            added: if spaces {
                None
            } else {
                Some(Arc::clone(added))
            },
            last_special: false,
        }
    }

    /// The text `id` adds (empty while a character is incomplete), and a note when the
    /// step was not an ordinary one.
    pub fn next(
        &mut self,
        tokenizer: &Tokenizer,
        id: i64,
    ) -> Result<(String, Option<StepNote>), DecodeError> {
        let (text, note) = match u32::try_from(id) {
            Ok(token) => self.protected_step(tokenizer, token)?,
            Err(_) => (None, Some(StepNote::InvalidId(id))),
        };
        let mut text = text.unwrap_or_default();
        if let Some(added) = &self.added {
            let special = u32::try_from(id).ok().and_then(|t| added.get(&t));
            if let (Some(content), true) = (special, self.last_special) {
                text = content.clone();
            }
            self.last_special = special.is_some();
        }
        Ok((text, note))
    }

    fn protected_step(
        &mut self,
        tokenizer: &Tokenizer,
        token: u32,
    ) -> Result<(Option<String>, Option<StepNote>), DecodeError> {
        match self.step(tokenizer, token) {
            Ok(text) => Ok((text, None)),
            Err(e) if e.0.starts_with(INVALID_PREFIX) => {
                self.ids.clear();
                self.prefix.clear();
                self.prefix_index = 0;
                Ok((self.step(tokenizer, token)?, Some(StepNote::Restarted)))
            }
            Err(e) => Err(e),
        }
    }

    fn step(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Option<String>, DecodeError> {
        tokenizers::tokenizer::step_decode_stream(
            &**tokenizer,
            vec![token],
            self.skip_special_tokens,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| DecodeError(e.to_string()))
    }
}
