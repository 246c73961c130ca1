//! Incremental detokenization of one request: the steps of the `tokenizers` package's
//! `DecodeStream` (which vLLM's fast detokenizer drives from Python, one call per token),
//! over a [`TextDecoder`].
//!
//! The stream keeps a window of recent ids and the text the window's first part decodes
//! to (the prefix). A new id is appended and the window decoded: when the result is
//! longer than the prefix and does not end in U+FFFD (an incomplete character), the part
//! past the prefix is the new text, and the window moves on to start where the previous
//! prefix ended. A result that no longer starts with the prefix is an invalid prefix.

use std::collections::HashMap;
use std::sync::Arc;

use super::candidates::incomplete;
use super::decoder::{DecodeError, TextDecoder};

/// What a step can report besides its text.
#[derive(Debug, PartialEq, Eq)]
pub enum StepNote {
    /// The id does not fit a token id: no text.
    InvalidId(i64),
    /// The stream restarted without its prompt after an invalid prefix.
    Restarted,
}

/// The outcome of one raw step.
enum Step {
    Text(Option<String>),
    InvalidPrefix,
}

/// One request's stream state.
#[derive(Debug)]
pub struct DecodeStream {
    /// The window: ids whose decode starts with `prefix`, and the ids after them.
    ids: Vec<u32>,
    prefix: String,
    /// How many ids of `ids` the prefix was decoded from.
    prefix_ids: usize,
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
            prefix_ids: 0,
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
        decoder: &TextDecoder,
        id: i64,
    ) -> Result<(String, Option<StepNote>), DecodeError> {
        let (text, note) = match u32::try_from(id) {
            Ok(token) => match self.step(decoder, token)? {
                Step::Text(text) => (text, None),
                Step::InvalidPrefix => {
                    // As vLLM does: start over without the prompt, then take the id again.
                    self.ids.clear();
                    self.prefix.clear();
                    self.prefix_ids = 0;
                    match self.step(decoder, token)? {
                        Step::Text(text) => (text, Some(StepNote::Restarted)),
                        Step::InvalidPrefix => {
                            return Err(DecodeError(format!(
                                "invalid prefix again after restarting the stream at id {token}"
                            )))
                        }
                    }
                }
            },
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

    fn step(&mut self, decoder: &TextDecoder, token: u32) -> Result<Step, DecodeError> {
        let skip = self.skip_special_tokens;
        if self.prefix.is_empty() && !self.ids.is_empty() {
            // An empty prefix (the prompt at the start, or a window that decodes to
            // nothing) is taken from the window, unless it ends inside a character.
            let text = decoder.decode(&self.ids, skip)?;
            if !incomplete(&text) {
                self.prefix = text;
                self.prefix_ids = self.ids.len();
            }
        }
        self.ids.push(token);
        let text = decoder.decode(&self.ids, skip)?;
        if text.len() <= self.prefix.len() || incomplete(&text) {
            return Ok(Step::Text(None));
        }
        let Some(new_text) = text.strip_prefix(self.prefix.as_str()) else {
            return Ok(Step::InvalidPrefix);
        };
        let new_text = new_text.to_owned();
        // The window now starts where the old prefix started to be decoded from.
        let moved = self.ids.len() - self.prefix_ids;
        self.ids.drain(..self.prefix_ids);
        self.prefix = decoder.decode(&self.ids, skip)?;
        self.prefix_ids = moved;
        Ok(Step::Text(Some(new_text)))
    }
}
