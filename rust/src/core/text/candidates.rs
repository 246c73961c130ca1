//! Token strings of logprob candidates.
//!
//! A candidate's string is its id decoded alone, except when that string ends in U+FFFD
//! (one piece of a multi-byte character): then vLLM decodes it again after up to four of
//! the request's preceding sampled ids and keeps the part the candidate adds. Both
//! releases this project speaks do the same; the steps are in [`correct`].

/// U+FFFD, what a decode gives for an incomplete UTF-8 sequence.
pub const REPLACEMENT: char = '\u{FFFD}';

/// The most sampled ids of context a correction looks back on (four bytes make the
/// longest UTF-8 character).
pub const MAX_CONTEXT: usize = 4;

/// Whether a candidate's own string needs [`correct`].
pub fn incomplete(s: &str) -> bool {
    s.ends_with(REPLACEMENT)
}

/// The string of `token` after the sampled ids `context` (oldest first): the shortest
/// context (1..=4 ids) whose decode with `token` completes its character gives it, less
/// the text of the context's leading ids that decode cleanly alone; empty when no
/// context completes it. `decode` decodes a run of ids, `single_incomplete` says whether
/// one id's own string ends in U+FFFD.
pub fn correct<E>(
    token: u32,
    context: &[u32],
    mut decode: impl FnMut(&[u32]) -> Result<String, E>,
    mut single_incomplete: impl FnMut(u32) -> Result<bool, E>,
) -> Result<String, E> {
    let most = context.len().min(MAX_CONTEXT);
    let mut ids: Vec<u32> = Vec::with_capacity(MAX_CONTEXT + 1);
    for n in 1..=most {
        let ctx = &context[context.len() - n..];
        ids.clear();
        ids.extend_from_slice(ctx);
        ids.push(token);
        let full = decode(&ids)?;
        if incomplete(&full) {
            continue;
        }
        // Trailing context ids that are themselves pieces of this character gave no text
        // when they were sampled: their bytes belong to this candidate's string.
        let mut clean_end = ctx.len();
        for j in (0..ctx.len()).rev() {
            if single_incomplete(ctx[j])? {
                clean_end = j;
            } else {
                break;
            }
        }
        let prefix = if clean_end > 0 {
            decode(&ctx[..clean_end])?
        } else {
            String::new()
        };
        if let Some(rest) = full.strip_prefix(prefix.as_str()) {
            return Ok(rest.to_owned());
        }
        // A normalizing decoder may change the prefix: keep what follows the shared part.
        let shared = super::chars::common_prefix(&prefix, &full);
        return Ok(full[super::chars::byte_at(&full, shared)..].to_owned());
    }
    Ok(String::new())
}
