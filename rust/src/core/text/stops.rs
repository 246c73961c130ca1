//! Stop strings: which one the text now contains, and where the text is cut.

use super::chars;

/// One stop string with its length in code points.
#[derive(Clone, Debug)]
pub struct StopString {
    pub text: String,
    pub chars: usize,
}

impl StopString {
    /// Wraps `text`, counting its code points once.
    pub fn new(text: String) -> Self {
        let chars = text.chars().count();
        StopString { text, chars }
    }
}

/// Where a matched stop string leaves the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The text stays whole (the stop string, kept, ends it already).
    None,
    /// The text keeps this many code points.
    At(usize),
}

/// vLLM 0.25.1's rule: the first stop string, in the order given, found in the part of
/// `text` that the last `new_chars` code points could complete. Returns its index in
/// `stops` and the cut: before the match, or after it when `include_in_output`.
pub fn first_in_order(
    text: &str,
    text_chars: usize,
    new_chars: usize,
    stops: &[StopString],
    include_in_output: bool,
) -> Option<(usize, Cut)> {
    if new_chars == 0 || stops.is_empty() {
        return None;
    }
    for (i, stop) in stops.iter().enumerate() {
        // Text before this window was searched when it was new.
        let start = 1 - new_chars as isize - stop.chars as isize;
        let Some(mut at) = chars::find_from(text, text_chars, &stop.text, start) else {
            continue;
        };
        if include_in_output {
            at += stop.chars;
            if at >= text_chars {
                return Some((i, Cut::None));
            }
        }
        return Some((i, Cut::At(at)));
    }
    None
}

/// vLLM 0.33.0's rule (and later releases'): of the stop strings found in the part of
/// `text` that the last `new_chars` code points could complete, the one that ends
/// earliest (ties: the order given), so that several tokens taken in one step stop where
/// taking them one at a time would. Returns its index in `stops` and the cut: before the
/// match, or after it when `include_in_output`.
pub fn earliest_end(
    text: &str,
    text_chars: usize,
    new_chars: usize,
    stops: &[StopString],
    include_in_output: bool,
) -> Option<(usize, Cut)> {
    if new_chars == 0 || stops.is_empty() {
        return None;
    }
    // (index in `stops`, where the match starts, where it ends), in code points.
    let mut best: Option<(usize, usize, usize)> = None;
    for (i, stop) in stops.iter().enumerate() {
        let start = 1 - new_chars as isize - stop.chars as isize;
        let Some(at) = chars::find_from(text, text_chars, &stop.text, start) else {
            continue;
        };
        let end = at + stop.chars;
        if best.is_none_or(|(_, _, best_end)| end < best_end) {
            best = Some((i, at, end));
        }
    }
    let (i, at, end) = best?;
    if !include_in_output {
        return Some((i, Cut::At(at)));
    }
    if end >= text_chars {
        return Some((i, Cut::None));
    }
    Some((i, Cut::At(end)))
}
