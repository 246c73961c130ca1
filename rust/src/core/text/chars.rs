//! Code-point offsets over UTF-8 strings: Python's `len`, slicing and `find` semantics.

/// Byte offset of code point `index` in `s` (`s.len()` at or past the end).
pub fn byte_at(s: &str, index: usize) -> usize {
    s.char_indices().nth(index).map_or(s.len(), |(b, _)| b)
}

/// Byte offset of the code point `back` code points before the end of `s` (0 when `s` is
/// shorter), found from the end so that the cost follows `back`, not the text's length.
pub fn byte_from_end(s: &str, back: usize) -> usize {
    if back == 0 {
        return s.len();
    }
    s.char_indices().rev().nth(back - 1).map_or(0, |(b, _)| b)
}

/// Python's `s.find(needle, start)` with a code-point `start` that may be negative (counted
/// from the end, clamped to 0) given `s`'s length in code points; `None` for -1.
pub fn find_from(s: &str, s_chars: usize, needle: &str, start: isize) -> Option<usize> {
    let len = s_chars as isize;
    let start = if start < 0 {
        (start + len).max(0)
    } else {
        start
    };
    if start > len {
        return None;
    }
    let start = start as usize;
    let from = byte_from_end(s, s_chars - start);
    let found = s[from..].find(needle)?;
    Some(start + s[from..from + found].chars().count())
}

/// The number of code points two strings share at their start.
pub fn common_prefix(a: &str, b: &str) -> usize {
    a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count()
}
