//! A request's output text: decoded pieces appended, stop strings checked, and the text
//! handed out whole or as deltas with the stop-string hold-back, as vLLM's
//! `BaseIncrementalDetokenizer` does (0.25.1's stop rule, or 0.33.0's: [`StopRules::earliest`]).

use super::chars;
use super::stops::{self, Cut, StopString};

/// What the request's sampling parameters say about stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopRules {
    pub stops: Vec<StopString>,
    pub min_tokens: usize,
    pub include_in_output: bool,
    /// vLLM 0.33.0's rule (and later releases'): the stop string that ends earliest wins,
    /// `min_tokens` counts per token offset, and the ids taken after the one that
    /// completed the stop string are dropped ([`OutputText::dropped`]). Otherwise
    /// 0.25.1's: the first stop string in the order given, every id kept.
    pub earliest: bool,
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
    /// Ids of the last update dropped after a stop string (0.33.0's rule).
    dropped: usize,
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
            dropped: 0,
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

    /// How many of the last update's ids a stop string dropped (they came after the id
    /// that completed it; only under [`StopRules::earliest`]): they are not counted, and
    /// the caller drops them from its own lists.
    pub fn dropped(&self) -> usize {
        self.dropped
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
        self.dropped = 0;
        if new_ids.is_empty() {
            return Ok(None);
        }
        if self.rules.earliest {
            return self.update_earliest(new_ids, stop_terminated, decode);
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
            self.cut(cut);
            index
        }))
    }

    /// `update` under 0.33.0's rule: the text's length after each new id decides where
    /// `min_tokens` ends and which ids a stop string keeps.
    fn update_earliest<E>(
        &mut self,
        new_ids: &[i64],
        stop_terminated: bool,
        mut decode: impl FnMut(i64) -> Result<String, E>,
    ) -> Result<Option<usize>, E> {
        let skip_last = stop_terminated && !self.rules.include_in_output;
        let decoded = if skip_last {
            &new_ids[..new_ids.len() - 1]
        } else {
            new_ids
        };
        let before = self.tokens;
        let checks = !self.rules.stops.is_empty();
        // The text's length (code points) after 0, 1, .. of the new ids.
        let mut offsets = Vec::with_capacity(if checks { new_ids.len() + 1 } else { 0 });
        if checks {
            offsets.push(self.chars);
        }
        for &id in decoded {
            self.tokens += 1;
            let piece = decode(id)?;
            self.chars += piece.chars().count();
            self.text.push_str(&piece);
            if checks {
                offsets.push(self.chars);
            }
        }
        if skip_last {
            self.tokens += 1;
            if checks {
                offsets.push(self.chars);
            }
        }
        if !checks || self.tokens <= self.rules.min_tokens {
            return Ok(None);
        }
        // No stop string may end inside the first min_tokens tokens.
        let check_from = offsets[self.rules.min_tokens.saturating_sub(before)];
        let Some((index, cut)) = stops::earliest_end(
            &self.text,
            self.chars,
            self.chars - check_from,
            &self.rules.stops,
            self.rules.include_in_output,
        ) else {
            return Ok(None);
        };
        let mut stop_end = match cut {
            Cut::None => self.chars,
            Cut::At(at) => at,
        };
        if !self.rules.include_in_output {
            stop_end += self.rules.stops[index].chars;
        }
        // The ids up to the first whose text reaches the stop string's end stay.
        let kept = 1 + offsets[1..].partition_point(|&end| end < stop_end);
        let kept = kept.min(new_ids.len());
        self.dropped = new_ids.len() - kept;
        self.tokens = before + kept;
        self.cut(cut);
        Ok(Some(index))
    }

    fn cut(&mut self, cut: Cut) {
        if let Cut::At(keep) = cut {
            self.text.truncate(chars::byte_at(&self.text, keep));
            self.chars = keep;
        }
    }

    /// The stop string at `index` of the rules.
    pub fn stop(&self, index: usize) -> &str {
        &self.rules.stops[index].text
    }

    /// Whether the next delta output has any text (what `next_output(finished, true)`
    /// would hand out), without handing it out.
    pub fn has_next_output(&self, finished: bool) -> bool {
        self.delta_end(finished).is_some()
    }

    /// In characters, where the next delta output ends (the text less the hold-back while
    /// unfinished), or None when it would be empty: nothing past what was handed out.
    fn delta_end(&self, finished: bool) -> Option<usize> {
        let hold = if finished { 0 } else { self.hold_back };
        self.chars.checked_sub(hold).filter(|&end| self.sent < end)
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
        let Some(end) = self.delta_end(finished) else {
            return "";
        };
        let end_byte = chars::byte_from_end(&self.text, hold);
        let start_byte = chars::byte_from_end(&self.text[..end_byte], end - self.sent);
        self.sent = end;
        &self.text[start_byte..end_byte]
    }
}
