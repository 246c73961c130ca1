//! A request's output text: decoded pieces appended, stop strings checked, and the text
//! handed out whole or as deltas with the stop-string hold-back, as vLLM 0.25.1's
//! `BaseIncrementalDetokenizer` does.

use super::chars;
use super::stops::{self, Cut, StopString};

/// What the request's sampling parameters say about stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopRules {
    pub stops: Vec<StopString>,
    pub min_tokens: usize,
    pub include_in_output: bool,
}

/// The growing output text of one request.
#[derive(Debug)]
pub struct OutputText {
    text: String,
    /// `text`'s length in code points.
    chars: usize,
    rules: StopRules,
    /// Code points held back from unfinished outputs: a stop string may still complete
    /// there, and must not have been streamed by then.
    hold_back: usize,
    /// Code points already handed out as deltas.
    sent: usize,
    /// Token ids seen so far (also the ones not decoded: a skipped stop token).
    tokens: usize,
}

impl OutputText {
    /// An empty text under `rules`.
    pub fn new(rules: StopRules) -> Self {
        let hold_back = if rules.stops.is_empty() || rules.include_in_output {
            0
        } else {
            rules
                .stops
                .iter()
                .map(|s| s.chars)
                .max()
                .unwrap_or(1)
                .saturating_sub(1)
        };
        OutputText {
            text: String::new(),
            chars: 0,
            rules,
            hold_back,
            sent: 0,
            tokens: 0,
        }
    }

    /// The whole text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Token ids counted so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Takes `new_ids`, decoding each with `decode` (a stop-terminated last id is counted
    /// but not decoded unless stop strings stay in the output), then checks the stop
    /// strings. Returns the index of the stop string that ended the text, if one did.
    pub fn update<E>(
        &mut self,
        new_ids: &[i64],
        stop_terminated: bool,
        mut decode: impl FnMut(i64) -> Result<String, E>,
    ) -> Result<Option<usize>, E> {
        if new_ids.is_empty() {
            return Ok(None);
        }
        let skip_last = stop_terminated && !self.rules.include_in_output;
        let decoded = if skip_last {
            &new_ids[..new_ids.len() - 1]
        } else {
            new_ids
        };
        let mut check_from = self.chars;
        for &id in decoded {
            self.tokens += 1;
            let piece = decode(id)?;
            self.chars += piece.chars().count();
            self.text.push_str(&piece);
            // No stop string may end inside the first min_tokens tokens.
            if self.rules.min_tokens > 0 && self.tokens <= self.rules.min_tokens {
                check_from = self.chars;
            }
        }
        if skip_last {
            self.tokens += 1;
        }
        if self.rules.stops.is_empty() || self.tokens <= self.rules.min_tokens {
            return Ok(None);
        }
        let found = stops::first_in_order(
            &self.text,
            self.chars,
            self.chars - check_from,
            &self.rules.stops,
            self.rules.include_in_output,
        );
        Ok(found.map(|(index, cut)| {
            if let Cut::At(keep) = cut {
                self.text.truncate(chars::byte_at(&self.text, keep));
                self.chars = keep;
            }
            index
        }))
    }

    /// The stop string at `index` of the rules.
    pub fn stop(&self, index: usize) -> &str {
        &self.rules.stops[index].text
    }

    /// The text for the next output: everything (or, with `delta`, what was not handed out
    /// yet), less the hold-back while unfinished.
    pub fn next_output(&mut self, finished: bool, delta: bool) -> &str {
        let hold = if finished { 0 } else { self.hold_back };
        if !delta {
            if hold == 0 {
                return &self.text;
            }
            return &self.text[..chars::byte_from_end(&self.text, hold)];
        }
        let Some(end) = self.chars.checked_sub(hold) else {
            return "";
        };
        if self.sent >= end {
            return "";
        }
        let end_byte = chars::byte_from_end(&self.text, hold);
        let start_byte = chars::byte_from_end(&self.text[..end_byte], end - self.sent);
        self.sent = end;
        &self.text[start_byte..end_byte]
    }
}
